"""What several commands do the same way: load the policy, read prompts, pick a drafter."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from codraft.config import Config, ConfigError, GenerateConfig
from codraft.models import Tokenizer, Transformer, load_model
from codraft.rollout.drafter import Drafter
from codraft.rollout.drafters import NgramDrafter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(cfg: Config) -> tuple[Transformer, Tokenizer]:
    model, tokenizer = load_model(cfg.model.path, dtype=DTYPES[cfg.model.dtype], device=cfg.model.device)
    return model.eval(), tokenizer


def encode_prompt(tokenizer: Tokenizer, text: str, chat_template: bool) -> list[int]:
    if chat_template:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text)


def read_prompts(gen: GenerateConfig) -> list[str]:
    """From generate.prompt, generate.prompts_file (JSONL, field "prompt"), or one demo prompt."""
    if gen.prompt is not None:
        return [gen.prompt]
    if gen.prompts_file is None:
        return ["What is 17 + 25? Answer with the number only."]
    prompts = []
    for line_no, line in enumerate(Path(gen.prompts_file).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"generate.prompts_file {gen.prompts_file}:{line_no}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ConfigError(f"generate.prompts_file {gen.prompts_file}:{line_no}: needs a non-empty string 'prompt'")
        prompts.append(row["prompt"])
    if not prompts:
        raise ConfigError(f"generate.prompts_file {gen.prompts_file} holds no prompts")
    return prompts


def build_drafter(gen: GenerateConfig, policy: Transformer) -> Drafter | None:
    if gen.drafter == "none":
        return None
    if gen.drafter == "ngram":
        return NgramDrafter()
    from codraft.drafts.export import check_family, load_draft

    draft = check_family(load_draft(gen.draft_path, policy), "generate.draft_path", "generate.drafter", gen.drafter)
    return draft.drafter()
