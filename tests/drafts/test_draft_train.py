"""`codraft draft-train`: each family trains on the policy's own responses, lowers its loss, writes its outputs."""

import json

import pytest

from codraft.cli import main

TINY = [
    "model.path=tiny-llama",
    "run.tensorboard=false",
    "task.max_operand=9",
    "draft_train.num_prompts=16",
    "draft_train.held_out_prompts=4",
    "draft_train.steps=12",
    "draft_train.batch_size=8",
    "draft_train.max_new_tokens=16",
    "draft_train.eval_max_new_tokens=12",
    "draft_train.warmup_steps=0",
    "draft_train.save_every=5",
    "draft.draft_vocab_size=64",
    "draft.num_anchors=4",
]


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_draft_train_lowers_the_loss_and_writes_metrics_draft_and_eval(tmp_path, family):
    assert main(["draft-train", *TINY, f"draft.family={family}", f"run.dir={tmp_path}"]) == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train_rows, eval_row = rows[:-1], rows[-1]
    assert [r["step"] for r in train_rows] == list(range(1, 13))
    losses = [r["loss/draft"] for r in train_rows]
    assert sum(losses[-3:]) < sum(losses[:3])
    assert eval_row["eval/t0/acceptance_length"] >= 1 and eval_row["eval/t1/acceptance_length"] >= 1
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["codraft_family"] == family
    assert (tmp_path / "draft" / "model.safetensors").is_file()
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["k"] == 7 and result["prompts"] == 4 and result["family"] == family
    for temperature in ("temperature_0", "temperature_1"):
        assert 1 <= result[temperature]["tau"] <= 8
        assert len(result[temperature]["accept_rate_per_position"]) <= 7
    sampled = result["temperature_1"]  # draft_train.eval_seeds (3) seeds from run.seed (0); greedy runs once
    assert sampled["seeds"] == [0, 1, 2] and "seeds" not in result["temperature_0"]
    assert sampled["tau"] == pytest.approx(sum(sampled["tau_per_seed"]) / 3)


@pytest.mark.parametrize("host_memory", ["keep", "release"])
def test_draft_train_logs_resident_memory_and_releases_freed_memory_each_step_under_release(tmp_path, monkeypatch,
                                                                                          host_memory):
    from codraft import host_memory as hm

    released = []
    monkeypatch.setattr(hm, "release_free_memory", lambda: released.append(1))
    args = ["draft-train", *TINY, "draft_train.steps=3", f"run.host_memory={host_memory}", f"run.dir={tmp_path}"]
    assert main(args) == 0
    train_rows = read_jsonl(tmp_path / "metrics.jsonl")[:-1]
    assert all(r["memory/rss_mib"] > 0 for r in train_rows)
    assert len(released) == (3 if host_memory == "release" else 0)
    assert all(("time/release_memory_s" in r) == (host_memory == "release") for r in train_rows)


def test_draft_train_on_a_jsonl_task(tmp_path):
    data = tmp_path / "task.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Say {i} twice.", "answer": f"{i} {i}"}) for i in range(30)))
    run = tmp_path / "run"
    args = ["draft-train", *TINY, "task.kind=jsonl", f"task.path={data}", "draft_train.steps=2", f"run.dir={run}"]
    assert main(args) == 0
    assert (run / "eval.json").is_file()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("draft.family=none", "draft.family must be one of eagle3, dflash, dspark for draft-train"),
        ("draft_train.batch_size=0", "config key 'draft_train.batch_size' must be >= 1"),
        ("draft_train.lr=0", "config key 'draft_train.lr' must be > 0"),
    ],
)
def test_draft_train_rejects_bad_config_in_one_line(tmp_path, capsys, override, message):
    assert main(["draft-train", *TINY, override, f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("codraft: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(("family", "draft_vocab_size"), [("eagle3", 0), ("eagle3", 16), ("dflash", 0), ("dspark", 0)])
def test_cached_policy_outputs_give_the_loss_and_gradients_of_a_fresh_policy_forward(family, draft_vocab_size):
    """The cache keeps the taps and only the logit rows that predict response tokens, as fp16 log-probs: every
    family's loss and gradients must come out as from the full fp32 forward (anchors drawn the same way)."""
    import torch

    from codraft.distill.distill import cached_batch, draft_batch, policy_outputs
    from codraft.drafts import build_draft
    from tests.drafts.blocks import draft_config, tiny_policy

    policy = tiny_policy(dtype=torch.float32)
    with torch.no_grad():  # a peaked policy: TV's min(p, q) kinks where p = q, and fp16 must not flip sides there
        policy.lm_head.weight.mul_(4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 35, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    completions = [torch.randint(3, 35, (n,), generator=g).tolist() for n in (12, 6, 15, 9)]
    draft = build_draft(draft_config(family, draft_vocab_size=draft_vocab_size), policy, None, corpus=completions)
    cache = policy_outputs(policy, draft, prompts, completions, batch_size=3)
    rows = [2, 0, 3]

    def loss_and_grads(batch):
        torch.manual_seed(7)  # the same DFlash anchors on both sides
        draft.zero_grad(set_to_none=True)
        loss, metrics = draft.loss(batch)
        loss.backward()
        return loss, metrics, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    fresh = loss_and_grads(draft_batch(policy, draft, [prompts[i] for i in rows], [completions[i] for i in rows]))
    cached = loss_and_grads(cached_batch([prompts[i] for i in rows], [completions[i] for i in rows],
                                         [cache[i] for i in rows], policy, draft))
    torch.testing.assert_close(cached[0], fresh[0], rtol=1e-4, atol=1e-5)
    assert cached[1].keys() == fresh[1].keys()
    for name in fresh[1]:
        assert cached[1][name] == pytest.approx(fresh[1][name], rel=1e-3, abs=1e-4), name
    assert cached[2].keys() == fresh[2].keys() and fresh[2]
    for name, grad in fresh[2].items():
        torch.testing.assert_close(cached[2][name], grad, rtol=1e-3, atol=5e-5)  # fp16 log-probs


def test_eagle3_caches_only_its_draft_vocabulary_and_trains_as_on_the_full_rows(monkeypatch):
    """EAGLE-3 reads the policy's draft-vocabulary columns and whether its top token is draftable: the cache keeps
    those (N + 1 columns instead of V) and the loss and gradients are bit for bit those of the full fp16 rows."""
    import torch

    from codraft.distill.distill import cached_batch, policy_outputs
    from codraft.drafts import build_draft
    from tests.drafts.blocks import V, draft_config, tiny_policy

    policy = tiny_policy(dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 35, (n,), generator=g).tolist() for n in (4, 8, 6)]
    completions = [torch.randint(3, 35, (n,), generator=g).tolist() for n in (10, 7, 13)]
    draft = build_draft(draft_config("eagle3", draft_vocab_size=12), policy, None, corpus=completions)
    reduced = policy_outputs(policy, draft, prompts, completions, batch_size=2)
    monkeypatch.setattr(type(draft), "policy_rows", lambda self, logits: logits)  # the full rows, reduced in the loss
    full = policy_outputs(policy, draft, prompts, completions, batch_size=2)
    monkeypatch.undo()
    assert [o.logprobs.shape[-1] for o in reduced] == [12 + 1] * 3 and full[0].logprobs.shape[-1] == V
    assert all(o.logprobs.dtype == torch.float16 for o in reduced)

    def loss_and_grads(outputs, reduced: bool):
        batch = cached_batch(prompts, completions, outputs)
        batch.policy_reduced = reduced
        draft.zero_grad(set_to_none=True)
        loss, metrics = draft.loss(batch)
        loss.backward()
        return loss, metrics, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    a, b = loss_and_grads(reduced, True), loss_and_grads(full, False)
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][n], b[2][n]) for n in a[2])


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_a_whole_vocabulary_family_caches_hidden_states_and_trains_as_on_the_fp16_rows(family):
    """DFlash and DSpark read all V columns of a row: the cache keeps the policy's last hidden state (H numbers
    instead of V) and each batch runs the head again, so the loss and gradients are bit for bit those of cached
    fp16 log-prob rows."""
    import torch

    from codraft.distill.distill import PolicyOutputs, cached_batch, policy_outputs
    from codraft.drafts import build_draft
    from tests.drafts.blocks import draft_config, tiny_policy

    policy = tiny_policy(dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 35, (n,), generator=g).tolist() for n in (4, 8, 6)]
    completions = [torch.randint(3, 35, (n,), generator=g).tolist() for n in (14, 9, 16)]
    draft = build_draft(draft_config(family), policy, None, corpus=completions)
    cache = policy_outputs(policy, draft, prompts, completions, batch_size=2)
    H = policy.args.hidden_size
    assert all(o.logprobs is None and o.hidden.shape == (len(c), H) for o, c in zip(cache, completions, strict=True))
    with torch.no_grad():  # the rows as the cache held them before: fp16 log-softmax of the policy's logits
        rows = [PolicyOutputs(o.taps, policy.logits(o.hidden).log_softmax(-1).half()) for o in cache]

    def loss_and_grads(outputs):
        torch.manual_seed(7)  # the same anchors on both sides
        draft.zero_grad(set_to_none=True)
        loss, metrics = draft.loss(cached_batch(prompts, completions, outputs, policy, draft))
        loss.backward()
        return loss, metrics, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    a, b = loss_and_grads(cache), loss_and_grads(rows)
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][n], b[2][n]) for n in a[2])


def test_draft_train_lr_warms_up_then_follows_a_cosine_to_its_floor():
    from codraft.distill.distill import warmup_cosine

    f = warmup_cosine(warmup_steps=2, total_steps=12, min_ratio=0.1)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(11) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
    assert f(2 + 9 / 2) == pytest.approx(0.55)  # half way down the cosine
    values = [f(s) for s in range(2, 12)]
    assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_bf16_matmuls_in_distillation_keep_the_fp32_loss_and_gradients(family):
    """draft_train.matmul_dtype=bfloat16 autocasts the draft's matmuls (attention kernels stay fp32): the loss
    and the gradients' directions are the fp32 ones up to bf16 rounding; float32 turns it off."""
    import torch

    from codraft.distill.distill import draft_batch
    from codraft.drafts import build_draft
    from codraft.models.autocast import training_autocast
    from tests.drafts.blocks import draft_config, tiny_policy

    policy = tiny_policy(dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 35, (n,), generator=g).tolist() for n in (5, 9, 3)]
    completions = [torch.randint(3, 35, (n,), generator=g).tolist() for n in (12, 6, 15)]
    draft = build_draft(draft_config(family), policy, None, corpus=completions)
    batch = draft_batch(policy, draft, prompts, completions)

    def loss_and_grads(matmul_dtype):
        torch.manual_seed(7)  # the same DFlash anchors on both sides
        draft.zero_grad(set_to_none=True)
        with training_autocast(draft, matmul_dtype):
            loss, _ = draft.loss(batch)
            autocast = torch.is_autocast_enabled("cpu")
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in draft.parameters() if p.grad is not None])
        return loss, grads, autocast

    fp32, bf16 = loss_and_grads("float32"), loss_and_grads("bfloat16")
    assert not fp32[2] and bf16[2] and bf16[0].dtype == torch.float32
    torch.testing.assert_close(bf16[0], fp32[0], rtol=2e-2, atol=1e-3)
    assert torch.nn.functional.cosine_similarity(bf16[1], fp32[1], dim=0) > 0.99
