"""`checkpoint.draft_init=auto` (distill/warm_start.py): hit, miss, a draft that does not fit, a damaged entry."""

import dataclasses
import logging
import threading

import pytest
import torch

from codraft.cli import main
from codraft.config import ConfigError, load_config
from codraft.distill import warm_start
from codraft.distill.distill import distillation_prompts
from codraft.drafts import build_draft
from codraft.drafts.export import WEIGHTS_FILE, export_draft, exported_trained_on, load_draft
from codraft.models import Transformer, load_policy
from codraft.models.linear import bf16_packing_available
from codraft.train.checkpoint import load_checkpoint
from codraft.train.trainer import Trainer
from tests.train.test_trainer import deterministic, run_metrics

pytestmark = pytest.mark.warm_start

TINY = ["model.path=tiny-llama", "run.tensorboard=false", "task.max_operand=9", "draft_train.num_prompts=4",
        "draft_train.steps=2", "draft_train.batch_size=2", "draft_train.max_new_tokens=8",
        "draft_train.generate_batch_size=4", "draft_train.warmup_steps=0", "draft.draft_vocab_size=64",
        "draft.num_anchors=2"]
TINY_RL = ["rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=6", "rl.adaptive=false",
           "rl.drift_every=0", "optim.lr=1e-3", "task.reward=tests.train.test_trainer:length_reward"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def distillations(monkeypatch) -> list[str]:
    """The family of every distillation that runs."""
    calls, distil = [], warm_start.distil
    monkeypatch.setattr(warm_start, "distil", lambda cfg, *a: calls.append(cfg.draft.family) or distil(cfg, *a))
    return calls


def warnings(caplog) -> list[str]:
    """What warm start warned about (other loggers may be at INFO after a CLI test set logging up)."""
    return [r.getMessage() for r in caplog.records
            if r.name == "codraft.distill.warm_start" and r.levelno >= logging.WARNING]


def setup(*overrides):
    cfg = load_config(None, [*TINY, *overrides])
    policy, tokenizer = load_policy(cfg)
    return cfg, policy, tokenizer


def entry_of(cfg, policy):
    return warm_start.entry_dir(cfg, warm_start.cache_key(cfg, policy))


def weights(draft) -> dict:
    """A copy: a loaded draft's tensors map its safetensors file, which the damage below rewrites in place."""
    return {k: v.clone() for k, v in draft.state_dict().items()}


def same_weights(a, b) -> bool:
    x, y = (weights(d) if not isinstance(d, dict) else d for d in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_a_miss_distils_and_caches_then_a_hit_loads_the_same_draft(distillations, cache, caplog, family):
    cfg, policy, tokenizer = setup(f"draft.family={family}")
    with caplog.at_level(logging.INFO, logger="codraft.distill.warm_start"):
        first = warm_start.warm_start_draft(cfg, policy, tokenizer)
    assert distillations == [family] and "no cached draft" in caplog.text
    entry = entry_of(cfg, policy)
    assert entry.parent == cache / "drafts" and entry.name.startswith(f"{family}-tiny-llama-")
    assert sorted(p.name for p in entry.iterdir()) == ["cache.json", "config.json", "model.safetensors"]
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no staging left behind
    second = warm_start.warm_start_draft(cfg, policy, tokenizer)
    assert distillations == [family] and not warnings(caplog)  # a hit: nothing distilled, nothing to warn about
    assert same_weights(first, second) and second.family == family
    assert same_weights(second, load_draft(entry, policy))  # the entry is an exported draft any loader reads
    assert exported_trained_on(entry) == distillation_prompts(cfg)  # so bench draft holds out the prompts after


def test_the_key_follows_what_the_draft_depends_on(distillations):
    cfg, policy, _ = setup()
    entry = entry_of(cfg, policy)
    for override in ("draft_train.steps=3", "task.max_operand=8", "draft.ttt_steps=2", "run.seed=1",
                     "model.dtype=bfloat16"):
        other, other_policy, _ = setup(override)
        assert entry_of(other, other_policy) != entry, override
    rollouts = [entry_of(*setup(f"model.inference_dtype={d}")[:2]) for d in ("float32", "bfloat16")]
    # the policy's answers and taps come from its rollout matmuls: bf16 ones where oneDNN has them on this CPU
    assert (rollouts[0] != rollouts[1]) == bf16_packing_available()
    assert entry_of(*setup("draft.family=dflash")[:2]).name.startswith("dflash-")
    assert entry_of(*setup("task.reward=correctness+format")[:2]) == entry  # distillation never scores
    with torch.no_grad():
        policy.layers["2"].mlp.up_proj.weight.mul_(1.01)  # a fine-tune of one layer
    assert entry_of(cfg, policy) != entry


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda e: (e / WEIGHTS_FILE).write_bytes((e / WEIGHTS_FILE).read_bytes()[:-100]), "truncated or altered"),
        (lambda e: (e / "cache.json").unlink(), "incomplete entry (no cache.json)"),
        (lambda e: (e / "cache.json").write_text('{"key": '), "cache.json is unreadable"),
        (lambda e: (e / "config.json").write_text("{}"), "config.json is missing, truncated or altered"),
    ],
)
def test_a_damaged_entry_is_never_loaded_and_is_rebuilt(distillations, monkeypatch, caplog, damage, reason):
    cfg, policy, tokenizer = setup()
    first = weights(warm_start.warm_start_draft(cfg, policy, tokenizer))
    entry = entry_of(cfg, policy)
    damage(entry)
    loaded, load = [], warm_start.load_draft
    monkeypatch.setattr(warm_start, "load_draft", lambda path, *a: loaded.append(
        (path / WEIGHTS_FILE).read_bytes()) or load(path, *a))
    rebuilt = warm_start.warm_start_draft(cfg, policy, tokenizer)
    (line,) = warnings(caplog)
    assert reason in line and "distilling a eagle3 draft" in line
    assert distillations == ["eagle3", "eagle3"]
    assert len(loaded) == 1  # only the rebuilt entry was read, never the damaged one
    assert same_weights(first, rebuilt)  # distillation is deterministic: the same draft again
    assert warm_start.read_entry(entry, warm_start.cache_key(cfg, policy), policy, "eagle3", "auto")[0] is not None


def plant(entry, key, draft) -> None:
    """`draft` in `entry` with a marker that is right for `key`: a valid entry that does not fit."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    warm_start.write_entry(entry, key, draft)


def test_a_cached_draft_of_other_shapes_or_family_is_not_used(distillations, caplog):
    cfg, policy, tokenizer = setup()
    key, entry = warm_start.cache_key(cfg, policy), entry_of(cfg, policy)
    other_vocab = Transformer(dataclasses.replace(policy.args, vocab_size=300))
    for draft, reason in [
        (build_draft(cfg.draft, other_vocab), "does not load for this policy: draft config vocab_size=300"),
        (build_draft(dataclasses.replace(cfg.draft, family="dflash"), policy, tokenizer), "holds a dflash draft"),
    ]:
        plant(entry, key, draft)
        caplog.clear()
        used = warm_start.warm_start_draft(cfg, policy, tokenizer)
        (line,) = warnings(caplog)
        assert reason in line, line
        assert used.family == "eagle3" and same_weights(used, load_draft(entry, policy))  # the rebuilt entry
    assert distillations == ["eagle3", "eagle3"]


def test_settings_the_distilled_weights_do_not_read_share_an_entry():
    cfg, policy, _ = setup()
    same = setup("draft.inference_dtype=float32", "task.reward=final_answer", "draft_train.eval_k=3",
                 "draft_train.held_out_prompts=5", "draft_train.cache_responses=false")[0]
    other = setup("draft_train.matmul_dtype=float32")[0]
    assert entry_of(same, policy) == entry_of(cfg, policy) != entry_of(other, policy)


def test_an_entry_made_for_another_key_is_not_used(distillations, caplog):
    cfg, policy, tokenizer = setup()
    key, entry = warm_start.cache_key(cfg, policy), entry_of(cfg, policy)
    plant(entry, key | {"draft_train": key["draft_train"] | {"steps": 99}}, build_draft(cfg.draft, policy))
    warm_start.warm_start_draft(cfg, policy, tokenizer)
    (line,) = warnings(caplog)
    assert "made for another draft_train" in line and distillations == ["eagle3"]


def test_a_second_process_waits_for_the_first_one_s_distillation(tmp_path):
    entry = tmp_path / "drafts" / "x"
    done = threading.Event()

    def second():
        with warm_start.entry_lock(entry):
            done.set()

    with warm_start.entry_lock(entry):
        waiter = threading.Thread(target=second)
        waiter.start()
        assert not done.wait(0.5)  # blocked while the lock is held
    assert done.wait(5)
    waiter.join()


def trainer_run(tmp_path, name, *overrides):
    cfg = load_config(None, [*TINY, *TINY_RL, f"run.dir={tmp_path / name}", *overrides])
    trainer = Trainer(cfg, tmp_path / name)
    return [trainer.train_step() for _ in range(2)], trainer


def test_train_with_draft_init_auto_is_the_same_run_on_a_miss_a_hit_and_from_the_entry(tmp_path, distillations):
    dflash = ["draft.family=dflash", "draft.block_size=3", "draft_train.max_new_tokens=16"]  # anchors use torch's RNG
    miss, a = trainer_run(tmp_path, "miss", *dflash, "checkpoint.draft_init=auto")
    hit, b = trainer_run(tmp_path, "hit", *dflash, "checkpoint.draft_init=auto")
    entry = entry_of(a.cfg, load_policy(a.cfg)[0])
    explicit, c = trainer_run(tmp_path, "explicit", *dflash, f"checkpoint.draft_init={entry}")
    assert distillations == ["dflash"] and miss[0]["loss/draft"] == miss[0]["loss/draft"]  # not NaN: anchors drawn
    for x, y, z in zip(miss, hit, explicit, strict=True):  # the distillation leaves the run's RNG as it was
        assert deterministic(x) == pytest.approx(deterministic(y), rel=0, abs=0, nan_ok=True)
        assert deterministic(x) == pytest.approx(deterministic(z), rel=0, abs=0, nan_ok=True)
    assert same_weights(a.draft, b.draft) and same_weights(a.draft, c.draft)
    assert same_weights(a.policy, b.policy) and same_weights(a.policy, c.policy)
    _, fresh = trainer_run(tmp_path, "none", *dflash, "checkpoint.draft_init=none")
    assert fresh.cfg.checkpoint.draft_init is None and distillations == ["dflash"]
    assert not same_weights(fresh.draft, a.draft)


def test_a_draft_from_a_dir_or_the_cache_runs_its_matmuls_in_the_run_s_inference_dtype(tmp_path, distillations):
    """draft.inference_dtype is the run's choice: a draft saved under another one (an exported dir, a cache entry,
    whose key leaves the setting out) follows the run's."""
    cfg, policy, tokenizer = setup("draft.family=eagle3", "draft.inference_dtype=int8")
    saved = build_draft(cfg.draft, policy, tokenizer, ())
    path = export_draft(saved, tmp_path / "saved")
    assert load_draft(path, policy).cfg.inference_dtype == "int8"  # what it was saved with
    plant(entry_of(cfg, policy), warm_start.cache_key(cfg, policy), saved)
    run = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, inference_dtype="float32"))
    for init in (str(path), "auto"):
        draft = warm_start.initial_draft(dataclasses.replace(run, checkpoint=dataclasses.replace(
            cfg.checkpoint, draft_init=init)), policy, tokenizer)
        assert draft.cfg.inference_dtype == "float32" and draft.inference_dtype == torch.float32
    assert distillations == []  # the entry was a hit


def test_draft_init_values_are_checked():
    assert load_config(None, ["checkpoint.draft_init=auto"]).checkpoint.draft_init == "auto"
    assert load_config(None, ["checkpoint.draft_init=none"]).checkpoint.draft_init is None
    with pytest.raises(ConfigError, match="checkpoint.draft_init: 'nowhere' is not an exported draft directory"):
        load_config(None, ["checkpoint.draft_init=nowhere"])


def test_export_draft_of_an_auto_run_holds_the_trained_draft(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *TINY, *TINY_RL, "rl.steps=1", "checkpoint.draft_init=auto", f"run.dir={run}"]) == 0
    assert main(["export-draft", f"export.source={run}", f"export.out_dir={tmp_path / 'out'}"]) == 0
    policy, _ = load_policy(load_config(run / "config.yaml", []))
    exported = load_draft(tmp_path / "out", policy)
    trained = load_checkpoint(run)["tensors"]["draft"]
    assert all(torch.equal(exported.state_dict()[k], trained[k]) for k in trained)
    assert len(run_metrics(run)) == 1
