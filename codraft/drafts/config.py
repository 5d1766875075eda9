"""DraftConfig: every option of the three draft families in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FAMILIES = ("eagle3", "dflash", "dspark")
LossKind = Literal["soft_ce", "hard_ce", "tv"]


@dataclass
class DraftConfig:
    family: Literal["eagle3", "dflash", "dspark", "none"] = "eagle3"
    loss: LossKind = "soft_ce"  # DSpark mixes ce_weight * CE(loss) + tv_weight * TV
    tap_layers: list[int] | None = None  # None = the family's default placement
    # EAGLE-3
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    draft_vocab_size: int = 8192  # most frequent target tokens; 0 = the whole target vocab
    # DFlash / DSpark
    num_layers: int = 2
    block_size: int = 8
    num_anchors: int = 16  # per sequence, sampled in the response
    gamma: float = 8.0  # slot weight exp(-(k-1)/gamma)
    mask_token_id: int | None = None  # None = a spare id chosen from the tokenizer
    # DSpark
    markov_rank: int = 64
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_head: bool = False

    def validate(self, num_policy_layers: int | None = None) -> None:
        """Raise ValueError naming the field; called where the config enters."""
        if self.ttt_steps < 1:
            raise ValueError(f"draft.ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.block_size < 2:
            raise ValueError(f"draft.block_size must be >= 2, got {self.block_size}")
        if self.num_layers < 1:
            raise ValueError(f"draft.num_layers must be >= 1, got {self.num_layers}")
        if self.num_anchors < 1:
            raise ValueError(f"draft.num_anchors must be >= 1, got {self.num_anchors}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft.draft_vocab_size must be >= 0, got {self.draft_vocab_size}")
        if self.markov_rank < 1:
            raise ValueError(f"draft.markov_rank must be >= 1, got {self.markov_rank}")
        if self.tap_layers is not None and num_policy_layers is not None:
            bad = [i for i in self.tap_layers if not 0 <= i < num_policy_layers]
            if bad:
                raise ValueError(
                    f"draft.tap_layers {bad} outside the policy's layers [0, {num_policy_layers - 1}]"
                )
