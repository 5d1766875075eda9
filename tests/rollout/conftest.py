import torch

from codraft.models import ModelArgs, Transformer
from codraft.rollout.adaptive import SpeculationController
from codraft.rollout.drafter import Drafter, Proposal


def tiny_model(vocab_size: int = 64, sharpen: float = 1.0, seed: int = 0, **overrides) -> Transformer:
    """Random tiny decoder; `sharpen` scales the head so distributions are far from uniform."""
    torch.manual_seed(seed)
    args = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        eos_token_id=[1],
        max_position_embeddings=512,
    )
    args.update(overrides)
    model = Transformer(ModelArgs(**args)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


class SkewedDrafter(Drafter):
    """A deliberately poor drafter: draws from a fixed random distribution unrelated to the target.

    With `point_mass`, proposes the same draws as point masses (no probs); with `vocab` (ascending target ids),
    draws only from those ids and reports q over them alone, as EAGLE-3's reduced vocabulary does.
    """

    def __init__(self, vocab_size: int, seed: int = 123, point_mass: bool = False,
                 vocab: torch.Tensor | None = None):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.q = (torch.randn(vocab_size if vocab is None else vocab.numel(), generator=g) * 2).softmax(-1)
        self.g = torch.Generator().manual_seed(seed + 1)
        self.point_mass = point_mass
        self.rows = 0

    def start(self, prompts, taps, params, max_len, generator=None):
        self.rows = len(prompts)

    def propose(self, pending, k, probe_rows=None):
        local = torch.multinomial(self.q.expand(self.rows, -1), k, replacement=True, generator=self.g)
        tokens = local if self.vocab is None else self.vocab[local]
        probs = None if self.point_mass else self.q.expand(self.rows, k, -1).clone()
        return Proposal(tokens=tokens, lengths=torch.full((self.rows,), k), probs=probs, vocab=self.vocab,
                        confidence=self.q[local])

    def keep_rows(self, rows):
        self.rows = rows.numel()


class Truncating(SpeculationController):
    """Always drafts 2 (or `k`) and verifies each row's drafts only while their cumulative confidence reaches 0.3."""

    def __init__(self, k: int = 2):
        super().__init__(k)
        self.fed: list[int] = []

    def choose(self, rows, remaining=None):
        return self.max_k

    def token_threshold(self, rows, k):
        return 0.3

    def observe(self, k, reached, accepted, rows, verify_s, draft_s, fed=None):
        self.fed.append(fed)
