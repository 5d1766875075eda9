"""`codraft generate`: prompts in, completions out, with the rollout engine's stats."""

from __future__ import annotations

import json
import logging

from codraft.commands.common import build_drafter, encode_prompt, read_prompts
from codraft.config import Config
from codraft.models import load_policy
from codraft.observability import MetricsLogger, prepare_run_dir, progress
from codraft.rollout import SpeculationController, generate

log = logging.getLogger(__name__)


def main(cfg: Config) -> int:
    gen = cfg.generate
    model, tokenizer = load_policy(cfg)
    texts = read_prompts(gen)
    prompts = [encode_prompt(tokenizer, t, gen.chat_template) for t in texts]
    drafter = build_drafter(gen, model, cfg.draft.inference_dtype)
    run_dir = prepare_run_dir(cfg, "generate")  # once every input is read: a refused run leaves nothing behind
    controller = SpeculationController(gen.num_speculative_tokens) if drafter and gen.adaptive else None

    out_path = run_dir / "generations.jsonl"
    with out_path.open("w") as out, MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard) as metrics:
        starts = range(0, len(prompts), gen.batch_size)
        for step, start in enumerate(progress(starts, desc="generate")):
            rollout = generate(
                model,
                prompts[start : start + gen.batch_size],
                drafter=drafter,
                num_speculative_tokens=gen.num_speculative_tokens,
                temperature=gen.temperature,
                top_p=gen.top_p,
                top_k=gen.top_k,
                max_new_tokens=gen.max_new_tokens,
                seed=cfg.run.seed + step,
                adaptive=controller if controller is not None else False,
                verification=gen.verification,
            )
            for i, (ids, reason) in enumerate(zip(rollout.tokens, rollout.finish_reasons, strict=True)):
                text = tokenizer.decode(ids, skip_special_tokens=True)
                out.write(json.dumps({"prompt": texts[start + i], "completion": text, "finish_reason": reason,
                                      "num_tokens": len(ids)}) + "\n")
                log.info("[%d] %s\n    -> %s", start + i, texts[start + i], text)
            stats = rollout.stats
            metrics.log(step, stats.summary())
            log.info("batch %d: %d tokens, %.1f tokens/s, tau %.2f, %d target forwards",
                     step, stats.tokens_generated, stats.tokens_per_s, stats.acceptance_length, stats.target_forwards)
    log.info("completions written to %s", out_path)
    return 0
