"""`codraft bench e2e` (bench/e2e.py): the summary's arithmetic and outputs on synthetic per-step records, the
skip of a completed variant, the resume of an interrupted one, a 2-step run of every variant on tiny-llama, and
the drafts' acceptance at fixed k against the final policies (bench/e2e_acceptance.py)."""

import json
import logging
import math
import os
import shutil
import signal
import statistics
from pathlib import Path

import pytest
import torch

from codraft.bench import e2e, e2e_acceptance, e2e_paired
from codraft.bench.soak import deterministic
from codraft.cli import main
from codraft.config import DRAFT_FAMILIES, ConfigError, load_config, with_overrides
from codraft.distill import warm_start
from codraft.train.checkpoint import save_checkpoint
from codraft.train.trainer import Trainer
from tests.drafts.test_warm_start import TINY, TINY_RL

pytestmark = pytest.mark.warm_start  # co-trained and frozen variants start from checkpoint.draft_init=auto


def records(n: int, rollout_s: float = 2.0, step_s: float = 4.0, tau=lambda i: 1.0, reward=lambda i: 0.5,
            length: float = 100.0, **extra) -> list[dict]:
    """n steps of synthetic metrics; the first step is 10x slower, as a warm-up step is."""
    slow = lambda i: 10.0 if i == 0 else 1.0  # noqa: E731
    return [{"step": i + 1, "time/rollout_s": rollout_s * slow(i), "time/step_s": step_s * slow(i),
             "spec/acceptance_length": tau(i), "reward/mean": reward(i), "kl/train_inference": 0.01,
             "response_length/mean": length, **extra}
            for i in range(n)]


def by_run(summary: list[dict]) -> dict[str, dict]:
    return {s["run"]: s for s in summary}


def test_speedups_are_baseline_seconds_over_run_seconds_on_the_shared_steps_after_the_first():
    history = {"baseline": records(12), "eagle3": records(10, rollout_s=1.0, step_s=3.0)}
    history["eagle3"][4]["time/step_s"] = 3.0 + 9 * 1.0  # one slow step counts in full: totals, not medians
    s = by_run(e2e.summarize(history))
    assert s["eagle3"]["timed_steps"] == 9  # steps 2..10: the baseline's 11 and 12 have no partner
    assert s["eagle3"]["rollout_speedup"] == pytest.approx(2.0)
    assert s["eagle3"]["e2e_speedup"] == pytest.approx(9 * 4.0 / (9 * 3.0 + 9.0))
    assert s["baseline"]["rollout_speedup"] == 1.0 and s["baseline"]["e2e_speedup"] == 1.0
    assert s["baseline"]["rollout_share"] == pytest.approx(0.5)


def test_a_run_that_drew_shorter_answers_shows_them_beside_its_speedup():
    history = {"baseline": records(5), "eagle3": records(5, rollout_s=1.0, step_s=3.0, length=50.0)}
    s = by_run(e2e.summarize(history))["eagle3"]
    assert s["rollout_speedup"] == pytest.approx(2.0)  # half the seconds, for half the tokens
    assert s["tokens_vs_baseline"] == pytest.approx(0.5) and s["rollout_tokens_per_s_vs_baseline"] == pytest.approx(1.0)
    # the step took 3 s of the baseline's 4 for half its tokens: 1.33x the seconds, 0.67x the throughput
    assert s["e2e_speedup"] == pytest.approx(4 / 3) and s["step_tokens_per_s_vs_baseline"] == pytest.approx(2 / 3)


def test_tau_windows_are_the_first_and_last_ten_steps():
    s = by_run(e2e.summarize({"baseline": records(25, tau=lambda i: float(i + 1))}))["baseline"]
    assert s["tau_first"] == pytest.approx(5.5) and s["tau_last"] == pytest.approx(20.5)
    assert s["tau_last_se"] == pytest.approx(statistics.stdev(range(16, 26)) / math.sqrt(10))


def test_first_position_acceptance_and_mean_k_are_summarised_beside_tau():
    """tau moves with the controller's k; the first draft position's acceptance is the draft's alone."""
    rows = records(25, **{"spec/mean_k": 2.0})
    for i, r in enumerate(rows):
        r["spec/accept_rate_pos_0"] = 0.5 if i < 10 else 0.7
    rows[0]["spec/accept_rate_pos_0"] = float("nan")  # a step without speculation has no rate
    s = by_run(e2e.summarize({"baseline": records(25), "eagle3": rows}))["eagle3"]
    assert s["accept1_first"] == pytest.approx(0.5) and s["accept1_last"] == pytest.approx(0.7)
    assert s["mean_k"] == pytest.approx(2.0)


def test_the_in_run_rollout_speedup_weighs_each_measured_step_by_its_seconds():
    """A 10 s rollout bought 2 s, a 1 s one 1 s: the run's rollouts took 11 s where plain decoding took 14."""
    rows = records(6)
    rows[2] |= {"rollout/speedup_measured": 1.2, "rollout/spec_s": 10.0, "rollout/plain_s": 12.0}
    rows[4] |= {"rollout/speedup_measured": 2.0, "rollout/spec_s": 1.0, "rollout/plain_s": 2.0}
    s = by_run(e2e.summarize({"baseline": records(6), "eagle3": rows}))
    assert s["eagle3"]["rollout_speedup_in_run"] == pytest.approx(14 / 11)
    assert s["eagle3"]["rollout_speedup_in_run_median"] == pytest.approx(1.6)
    assert s["eagle3"]["rollout_speedup_in_run_se"] == pytest.approx(statistics.stdev([1.2, 2.0]) / math.sqrt(2))
    assert s["eagle3"]["rollout_speedup_in_run_steps"] == 2
    assert s["baseline"]["rollout_speedup_in_run"] is None and s["baseline"]["rollout_speedup_in_run_se"] is None


def test_the_in_run_e2e_speedup_is_the_draft_free_steps_seconds_over_the_run_s():
    """Two measured steps of 10 s and 5 s whose draft-free versions took 12 s and 5.5 s: 17.5 / 15."""
    rows = records(6)
    rows[2] |= {"rollout/speedup_measured": 1.5, "rollout/spec_s": 4.0, "rollout/plain_s": 6.0,
                "time/step_s": 10.0, "step/plain_s": 12.0, "step/speedup_measured": 1.2}
    rows[4] |= {"rollout/speedup_measured": 1.5, "rollout/spec_s": 1.0, "rollout/plain_s": 1.5,
                "time/step_s": 5.0, "step/plain_s": 5.5, "step/speedup_measured": 1.1}
    rows[5] |= {"rollout/speedup_measured": 1.5, "rollout/spec_s": 1.0, "rollout/plain_s": 1.5}  # no draft timing
    s = by_run(e2e.summarize({"baseline": records(6), "eagle3": rows}))["eagle3"]
    assert s["e2e_speedup_in_run"] == pytest.approx(17.5 / 15)
    assert s["e2e_speedup_in_run_se"] == pytest.approx(statistics.stdev([1.2, 1.1]) / math.sqrt(2))
    assert s["e2e_speedup_in_run_steps"] == 2 and s["rollout_speedup_in_run_steps"] == 3


def test_reward_is_compared_within_two_combined_standard_errors():
    wobble = lambda mean: lambda i: mean + (0.1 if i % 2 else -0.1)  # noqa: E731
    history = {"baseline": records(20, reward=wobble(0.5)), "same": records(20, reward=wobble(0.52)),
               "better": records(20, reward=wobble(0.9))}
    s = by_run(e2e.summarize(history))
    se = statistics.stdev([0.4, 0.6] * 5) / math.sqrt(10)
    assert s["baseline"]["reward_last"] == pytest.approx(0.5) and s["baseline"]["reward_last_se"] == pytest.approx(se)
    assert s["same"]["reward_diff"] == pytest.approx(0.02) and s["same"]["reward_within_2se"] is True
    assert s["better"]["reward_diff"] == pytest.approx(0.4) and s["better"]["reward_within_2se"] is False
    assert s["baseline"]["reward_within_2se"] is None  # the reference is not tested against itself
    assert abs(s["better"]["reward_diff"]) > 2 * math.sqrt(2) * se  # the bound the test uses


def test_outputs_from_synthetic_records_hold_every_run_and_say_what_was_measured(tmp_path):
    cfg = load_config(None, ["task.kind=chain", "task.reward=final_answer", "rl.steps=12", "rl.prompts_per_step=8",
                             "rl.max_new_tokens=16", "rl.temperature=1"])
    history = {"baseline": records(12, rollout_s=1.0, step_s=4.0, **{"drift/kl_step0": 0.0}),
               "dspark": records(12, rollout_s=0.5, step_s=3.5, tau=lambda i: 2.0 + i / 10)}
    history["dspark"][4]["drift/kl_step0"] = 0.03
    history["dspark"][0]["spec/accept_rate_pos_0"], history["dspark"][1]["spec/accept_rate_pos_0"] = 0.5, 0.7
    history["dspark"][4] |= {"rollout/speedup_measured": 1.2, "rollout/spec_s": 10.0, "rollout/plain_s": 12.0}
    history["dspark"][9] |= {"rollout/speedup_measured": 1.4, "rollout/spec_s": 1.0, "rollout/plain_s": 1.4}
    variants = {"baseline": ["draft.family=none"], "dspark": e2e.co_trained_overrides("dspark")}
    payload = e2e.write_outputs(history, variants, cfg, tmp_path)
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert saved["history"] == history and saved["variants"] == variants
    assert by_run(saved["summary"])["dspark"]["drift_last"] == 0.03 and saved["summary"] == payload["summary"]
    assert saved["workload"]["task"]["kind"] == "chain" and saved["reward_test"] == e2e.REWARD_TEST
    md = (tmp_path / "e2e.md").read_text()
    header, _, baseline, dspark = md.splitlines()[:4]
    assert header.startswith("| run | steps | tau first 10 | tau last 10 ± SE | accept pos 1 first / last 10 | "
                             "mean k | rollout share | rollout speedup |")
    # first-position acceptance only in the first two records (none in the last 10), no k: n/a where none
    # no draft training timed in these records: no in-run e2e speedup
    assert dspark.startswith("| dspark | 12 | 2.45 | 2.65 ± 0.096 | 0.6 / n/a | n/a | 0.143 | 2 | 1.22 ± 0.1 (2) "
                             "| 1.14 | n/a | 1 | 2 | 1.14 | 0.500 ± 0.000 | 0 | yes |")
    assert baseline.split(" | ")[16] == "n/a"  # the baseline is the reference of the reward test
    assert baseline.split(" | ")[8] == baseline.split(" | ")[10] == "n/a"  # no draft, no in-run measurement
    assert "no estimate" in md and "2 * sqrt(SE_run^2 + SE_baseline^2)" in md
    assert "12 steps x 8 prompts x group 4, max 16 new tokens at T=1, task chain (4-24 terms), seed 0" in md
    assert "The baseline spent 25% of its step in rollout (< 40%)" in md  # a workload that is not rollout-bound
    assert (tmp_path / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trained_vs_initial_draft_pairs_the_second_half_s_scored_steps():
    history = {"baseline": records(8), "eagle3": records(8)}
    for step, trained, initial in ((2, 0.9, 0.9), (4, 0.4, 0.3), (6, 0.6, 0.5), (7, math.nan, 0.1), (8, 0.7, 0.5)):
        row = history["eagle3"][step - 1]
        row |= {"draft/expected_accept_pos_0": trained, "frozen_draft/expected_accept_pos_0": initial,
                "draft/acc_pos_0": 0.0, "frozen_draft/acc_pos_0": 1.0}  # not an expected acceptance: left out
    (row,) = e2e_paired.paired_rows(history)
    assert row["run"] == "eagle3" and row["metric"] == "expected_accept_pos_0" and row["steps"] == [6, 8]
    assert (row["trained"], row["initial"], row["gain"]) == pytest.approx((0.65, 0.5, 0.15))
    assert row["gain_se"] == pytest.approx(statistics.stdev([0.1, 0.2]) / math.sqrt(2))
    assert "| eagle3 | expected_accept_pos_0 | 2 | 0.65 | 0.5 | 0.150 ± 0.050 |" in e2e_paired.paired_table([row])


def tiny(tmp_path, *overrides: str):
    return load_config(None, [*TINY, *TINY_RL, "rl.steps=2", f"bench.out_dir={tmp_path}", "bench.e2e_eval_prompts=2",
                              "bench.e2e_eval_max_new_tokens=6", *overrides])


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "cache"))


def forbid_training(monkeypatch):
    monkeypatch.setattr(e2e, "Trainer", lambda *a, **k: pytest.fail("a completed variant was trained again"))


def test_a_completed_variant_is_read_back_and_not_re_run(tmp_path, monkeypatch):
    forbid_training(monkeypatch)
    cfg = with_overrides(tiny(tmp_path), ["draft.family=none"])
    run_dir = tmp_path / "baseline"
    run_dir.mkdir()
    rows = records(2)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / e2e.DONE).write_text(json.dumps(e2e.identity(cfg)))
    assert e2e.run_variants({"baseline": (cfg, run_dir)}) == {"baseline": rows}
    with pytest.raises(ConfigError, match=r"holds a completed baseline run of another config \(rl.steps\)"):
        e2e.run_variants({"baseline": (with_overrides(cfg, ["rl.steps=3"]), run_dir)})


def test_a_variant_stopped_by_a_signal_resumes_from_its_checkpoint_and_matches_an_unstopped_run(tmp_path,
                                                                                                 monkeypatch):
    cfg = with_overrides(tiny(tmp_path), ["draft.family=none", "checkpoint.every=0"])
    unstopped = e2e.run_variants({"baseline": (cfg, tmp_path / "unstopped")})["baseline"]
    steps, train_step = [], Trainer.train_step

    def step_then_sigint_after_step_1(self):
        row = train_step(self)
        steps.append(self.step)
        if self.step == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while step 1 runs: it finishes, is saved, the bench stops
        return row

    monkeypatch.setattr(Trainer, "train_step", step_then_sigint_after_step_1)
    run_dir = tmp_path / "stopped"
    with pytest.raises(e2e.Interrupted) as stop:
        e2e.run_variants({"baseline": (cfg, run_dir)})
    assert (stop.value.variant, stop.value.exit_code) == ("baseline", 130) and not (run_dir / e2e.DONE).exists()
    resumed = e2e.run_variants({"baseline": (cfg, run_dir)})["baseline"]
    assert steps == [1, 2] and (run_dir / e2e.DONE).is_file()  # step 1 was not trained again
    assert untimed(resumed) == untimed(unstopped)


def untimed(rows: list[dict]) -> list[dict]:
    return [deterministic(r) for r in rows]  # the soak's rule: what measures the machine left out


def test_variants_taking_turns_train_as_each_does_alone(tmp_path):
    # dflash samples its anchors from the torch RNG: two of them drawing from one stream would change both
    cfg = with_overrides(tiny(tmp_path), ["checkpoint.every=0", "draft.family=dflash", "checkpoint.draft_init=none",
                                          "rl.max_new_tokens=16", "task.reward=tests.train.test_trainer:length_reward"])
    alone = e2e.run_variants({"dflash": (cfg, tmp_path / "alone")})["dflash"]
    turns = e2e.run_variants({"first": (cfg, tmp_path / "first"), "second": (cfg, tmp_path / "second")})
    assert "loss/draft" in alone[-1] and untimed(turns["first"]) == untimed(turns["second"])
    assert len(turns["first"]) == len(alone) == 2
    for in_turn, by_itself in zip(untimed(turns["first"]), untimed(alone), strict=True):  # up to kernels' float noise
        assert in_turn == pytest.approx(by_itself, rel=1e-3, nan_ok=True)


def test_bench_e2e_runs_every_variant_on_tiny_llama_then_skips_them_all(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, "checkpoint.every=0", "rl.drift_every=1", "rl.frozen_draft_every=1")
    payload = e2e.run_e2e_bench(cfg, tmp_path / "out", tmp_path / "runs")
    history = payload["history"]
    best = max(DRAFT_FAMILIES, key=lambda f: e2e.window_mean(history[f], "spec/acceptance_length", last=True))
    assert list(history) == ["baseline", "eagle3", "dflash", "dspark", f"frozen_{best}"]
    assert all([r["step"] for r in rows] == [1, 2] for rows in history.values())
    assert all("drift/kl_step0" in r and "kl/train_inference" in r for rows in history.values() for r in rows)
    assert "loss/draft" in history[best][0] and "loss/draft" not in history[f"frozen_{best}"][0]
    # the co-trained runs score their initial draft beside the trained one; the frozen run has nothing to pair
    assert {r["run"] for r in payload["trained_vs_initial_draft"]} == set(DRAFT_FAMILIES)
    assert not any(k.startswith("frozen_draft/") for k in history[f"frozen_{best}"][1])
    assert by_run(payload["summary"])["baseline"]["rollout_speedup"] == 1.0
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"e2e.json", "e2e.md", "e2e.png"}
    measured = [(r["policy"], r["draft"]) for r in payload["acceptance_at_fixed_k"]]
    assert measured == [*(("step 0", f"{f} warm start") for f in DRAFT_FAMILIES),
                        *((f"{f} final", d) for f in DRAFT_FAMILIES for d in (f"{f} final", f"{f} warm start")),
                        (f"frozen_{best} final", f"frozen_{best} final")]
    assert all(r["tau_t0"] >= 1 and r["tau_t1"] >= 1 for r in payload["acceptance_at_fixed_k"])
    md = (tmp_path / "out" / "e2e.md").read_text()
    assert "| step 0 | eagle3 warm start |" in md and "Acceptance at fixed k = 7 (no controller)" in md
    assert "| eagle3 | expected_accept_pos_0 | 1 |" in md and "Trained vs initial draft on the same batches" in md
    forbid_training(monkeypatch)
    with pytest.raises(ConfigError, match="^checkpoint.resume: bench e2e resumes each variant from its own run dir"):
        e2e.run_e2e_bench(with_overrides(cfg, [f"checkpoint.resume={tmp_path / 'runs' / 'eagle3'}"]),
                          tmp_path / "out", tmp_path / "runs")
    assert e2e.run_e2e_bench(cfg, tmp_path / "out", tmp_path / "runs")["history"] == history


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fixed_k_acceptance_measures_each_runs_final_policy_and_draft_and_the_warm_start_beside_them(
        tmp_path, monkeypatch, caplog):
    cfg = tiny(tmp_path, "checkpoint.every=0", "draft.family=eagle3", "optim.lr=1e-2")
    runs = {"eagle3": (cfg, tmp_path / "eagle3"),
            "frozen_eagle3": (with_overrides(cfg, ["rl.draft_weight=0"]), tmp_path / "frozen")}
    live = {name: e2e.VariantRun(name, c, d) for name, (c, d) in runs.items()}
    for v in live.values():
        v.step()
        v.step()
        v.close()
    seen = []

    def record(policy, draft, prompts, *, k, max_new_tokens, seed):
        seen.append(({n: t.clone() for n, t in policy.state_dict().items()},
                     {n: t.clone() for n, t in draft.state_dict().items()}))
        assert (len(prompts), k, max_new_tokens) == (2, cfg.draft_train.eval_k, 6)
        return {f"temperature_{t:g}": {"tau": 1.5, "accept_rate_per_position": [0.5]} for t in (0.0, 1.0)}

    monkeypatch.setattr(e2e_acceptance, "measure_acceptance", record)
    # every draft comes from the cache the runs filled: a policy that trained would miss it and distil again
    monkeypatch.setattr(warm_start, "distil", lambda *a: pytest.fail("the warm start was distilled again"))
    rows = e2e_acceptance.acceptance_at_fixed_k(cfg, runs)
    assert [(r["policy"], r["draft"]) for r in rows] == [
        ("step 0", "eagle3 warm start"), ("eagle3 final", "eagle3 final"), ("eagle3 final", "eagle3 warm start"),
        ("frozen_eagle3 final", "frozen_eagle3 final")]
    (step0, warm), (policy, draft), (policy_again, warm_again), (frozen_policy, frozen_draft) = seen
    co_trained, frozen = live["eagle3"].trainer, live["frozen_eagle3"].trainer
    assert same(policy, co_trained.policy.state_dict()) and same(draft, co_trained.draft.state_dict())
    assert same(policy_again, policy) and same(warm_again, warm)  # the warm start against the same policy
    assert same(frozen_policy, frozen.policy.state_dict()) and same(frozen_draft, warm)  # never updated
    assert not same(policy, step0) and not same(draft, warm)  # both moved in the co-trained run
    assert "| eagle3 final | eagle3 warm start | 1.5 | 1.5 | 0.5 | 0.5 |" in e2e_acceptance.acceptance_table(rows, cfg)
    shutil.rmtree(tmp_path / "frozen" / "checkpoints")  # read back later, its checkpoints removed: left out, no crash
    with caplog.at_level(logging.WARNING):
        rows = e2e_acceptance.acceptance_at_fixed_k(cfg, runs)
    assert [r["policy"] for r in rows] == ["step 0", "eagle3 final", "eagle3 final"]
    assert "frozen_eagle3 has no checkpoint to measure" in caplog.text


def test_no_fixed_k_acceptance_without_drafted_runs_or_prompts(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e_acceptance, "load_policy", lambda *a: pytest.fail("nothing to measure"))
    cfg = tiny(tmp_path)
    assert e2e_acceptance.acceptance_at_fixed_k(cfg, {"baseline": (with_overrides(cfg, ["draft.family=none"]),
                                                                    tmp_path)}) == []
    assert e2e_acceptance.acceptance_at_fixed_k(with_overrides(cfg, ["bench.e2e_eval_prompts=0"]),
                                                {"eagle3": (cfg, tmp_path)}) == []
    with pytest.raises(ConfigError, match="bench.e2e_eval_prompts"):
        with_overrides(cfg, ["bench.e2e_eval_prompts=-1"])


def test_fixed_k_acceptance_refuses_a_checkpoint_without_the_runs_weights(tmp_path):
    cfg = tiny(tmp_path, "draft.family=eagle3")
    run_dir = tmp_path / "eagle3"  # e.g. a pipeline-parallel run's, whose policy is saved per stage
    save_checkpoint(run_dir, 2, tensors={"policy_stage0": {"w": torch.zeros(1)}}, optimizers={}, meta={}, keep=1)
    with pytest.raises(ConfigError, match=r"^run.dir: the eagle3 checkpoint .*step_000002 does not hold this run's"):
        e2e_acceptance.acceptance_at_fixed_k(cfg, {"eagle3": (cfg, run_dir)})


def test_bench_e2e_command_runs_the_bench_and_exits_as_a_signalled_run_when_stopped(tmp_path, monkeypatch):
    args = ["bench", "e2e", *TINY, *TINY_RL, "rl.steps=1", "bench.e2e_families=[]", "bench.e2e_frozen=none",
            f"run.dir={tmp_path / 'runs'}", f"bench.out_dir={tmp_path / 'out'}"]
    assert main(args) == 0
    assert (tmp_path / "out" / "e2e.md").read_text().startswith("| run | steps |")
    assert (tmp_path / "runs" / "baseline" / e2e.DONE).is_file()

    def stopped(*args, **kwargs):
        raise e2e.Interrupted("dflash", 143)

    monkeypatch.setattr(e2e, "run_e2e_bench", stopped)
    assert main(args) == 143


def test_the_shipped_workload_config_loads_and_asks_for_at_least_40_steps_of_long_answers():
    cfg = load_config(Path(__file__).parents[2] / "configs" / "e2e_chain.yaml", [])
    assert (cfg.model.path, cfg.task.kind, cfg.task.reward) == ("smollm2-135m", "chain", "chain_steps")
    assert cfg.rl.steps >= 40 and cfg.rl.max_new_tokens >= 128 and cfg.draft_train.max_new_tokens >= 128


def test_a_draft_dir_in_the_base_config_warm_starts_its_own_family_and_the_others_use_the_cache(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"codraft_family": "dflash"}))
    base = with_overrides(tiny(tmp_path), [f"checkpoint.draft_init={draft}"])
    assert e2e.warm_start(base, "dflash") == str(draft)
    assert e2e.warm_start(base, "eagle3") == "auto"
    assert e2e.warm_start(tiny(tmp_path), "dflash") == "auto"
    assert with_overrides(base, e2e.frozen_overrides("dflash", str(draft))).checkpoint.draft_init == str(draft)
    assert with_overrides(base, ["draft.family=none", "checkpoint.draft_init=none"]).checkpoint.draft_init is None
