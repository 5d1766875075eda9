"""`codraft bench <name>`: the benchmarks, each writing results/<name>.json and .md."""

from __future__ import annotations

import logging

from codraft.config import Config, ConfigError

log = logging.getLogger(__name__)


def _rollout(cfg: Config) -> None:
    import importlib.util

    from codraft.bench.rollout import run_rollout_bench
    from codraft.models import load_policy
    from codraft.models.presets import smollm2_transformers

    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("bench rollout compares against transformers: pip install transformers accelerate")
    model, tokenizer = load_policy(cfg)
    if cfg.model.path != "smollm2-135m":
        raise ConfigError("bench rollout loads transformers' copy of the default model: keep model.path=smollm2-135m")
    hf = smollm2_transformers(model.lm_head.weight.dtype)
    b = cfg.bench
    run_rollout_bench(
        model,
        tokenizer,
        hf,
        batch_sizes=b.batch_sizes,
        max_new_tokens=b.max_new_tokens,
        repeats=b.repeats,
        k=b.num_speculative_tokens,
        out_dir=b.out_dir,
    )


def _attention(cfg: Config) -> None:
    from codraft.bench.attention import run_attention_bench

    run_attention_bench(cfg.bench.out_dir, seq_lens=tuple(cfg.bench.seq_lens))


def _draft(cfg: Config) -> None:
    from codraft.bench.draft import bench_draft

    bench_draft(cfg)


def _e2e(cfg: Config) -> int:
    from codraft.bench.e2e import Interrupted, run_e2e_bench

    try:
        run_e2e_bench(cfg, cfg.bench.out_dir, runs_dir=cfg.run.dir or "runs/e2e")
    except Interrupted as stop:
        log.info("bench e2e stopped in %s after a checkpoint; the same command resumes it", stop.variant)
        return stop.exit_code
    return 0


def _tapchannel(cfg: Config) -> None:
    from codraft.bench.tapchannel import run_tapchannel_bench

    run_tapchannel_bench(cfg.bench.out_dir, repeats=cfg.bench.repeats)


def _soak(cfg: Config) -> None:
    from codraft.bench.soak import run_soak_bench

    run_soak_bench(cfg, cfg.bench.out_dir, runs_dir=cfg.run.dir or "runs/soak")


BENCHMARKS = {"rollout": _rollout, "attention": _attention, "draft": _draft, "e2e": _e2e, "tapchannel": _tapchannel,
              "soak": _soak}


def main(cfg: Config) -> int:
    name = cfg.bench.benchmark
    if name not in BENCHMARKS:
        raise ConfigError(f"bench {name} is not available yet; available: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name](cfg) or 0
