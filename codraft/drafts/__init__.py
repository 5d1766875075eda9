"""Draft models on one base (base.py); each family module registers itself for export/load (export.py)."""

from __future__ import annotations

from collections.abc import Sequence

from codraft.config import DRAFT_FAMILIES, DraftConfig
from codraft.drafts import dflash, dspark, eagle3
from codraft.drafts.base import DraftBatch, DraftModel
from codraft.drafts.vocab import count_tokens
from codraft.models import Tokenizer, Transformer

__all__ = ["DraftBatch", "DraftModel", "build_draft"]


def build_draft(cfg: DraftConfig, policy: Transformer, tokenizer: Tokenizer | None = None,
                corpus: Sequence[Sequence[int]] = ()) -> DraftModel:
    """A fresh draft of `cfg.family` for `policy`, attached to it.

    `corpus` (token-id sequences, e.g. tokenized task prompts or rollouts) sets the reduced
    draft vocabulary from token counts (EAGLE-3's head; the policy-head rows DFlash/DSpark
    score at inference); ties, and ids never seen, fall back to id order, which for BPE
    vocabularies roughly follows merge frequency.
    """
    args = policy.args
    counts = count_tokens(corpus, args.vocab_size) if corpus else None
    if cfg.family == "eagle3":
        draft = eagle3.Eagle3Draft(cfg, args, token_counts=counts)
        if cfg.head_from_policy:
            draft.copy_policy_head(policy)
        if cfg.layer_from_policy is not None:
            draft.copy_policy_layer(policy, cfg.layer_from_policy)
    elif cfg.family in ("dflash", "dspark"):
        family = dflash.DFlashDraft if cfg.family == "dflash" else dspark.DSparkDraft
        special = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
        draft = family(cfg, args, tokenizer_vocab_size=tokenizer.vocab_size if tokenizer else None,
                       special_ids=special, token_counts=counts)
    else:
        raise ValueError(f"draft.family must be one of {', '.join(DRAFT_FAMILIES)} to build a draft; "
                         f"got {cfg.family!r}")
    param = next(policy.parameters())
    return draft.to(device=param.device, dtype=param.dtype).attach(policy)


