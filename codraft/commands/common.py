"""What several commands do the same way: read prompts, pick a drafter."""

from __future__ import annotations

from codraft.config import ConfigError, GenerateConfig
from codraft.drafts.export import check_family, read_draft
from codraft.jsonl import read_jsonl
from codraft.models import Tokenizer, Transformer
from codraft.rollout.drafter import Drafter
from codraft.rollout.drafters import NgramDrafter


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
    try:
        rows = list(read_jsonl(gen.prompts_file))
    except ValueError as e:  # not UTF-8, not JSON
        raise ConfigError(f"generate.prompts_file {e}") from e
    prompts = []
    for where, row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ConfigError(f"generate.prompts_file {where}: needs a non-empty string 'prompt'")
        prompts.append(row["prompt"])
    if not prompts:
        raise ConfigError(f"generate.prompts_file {gen.prompts_file} holds no prompts")
    return prompts


def build_drafter(gen: GenerateConfig, policy: Transformer, inference_dtype: str) -> Drafter | None:
    """`generate.drafter`'s drafter; a learned one's matmuls run in `inference_dtype` (`draft.inference_dtype`)."""
    if gen.drafter == "none":
        return None
    if gen.drafter == "ngram":
        return NgramDrafter()
    draft = read_draft(gen.draft_path, policy, "generate.draft_path", inference_dtype)
    draft = check_family(draft, "generate.draft_path", "generate.drafter", gen.drafter)
    return draft.drafter()
