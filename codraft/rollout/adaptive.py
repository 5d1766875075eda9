"""Adaptive speculation: pick k per verify step from acceptance and measured cost.

With per-position conditional acceptance a_i = P(draft i accepted | draft i-1
accepted), k drafts emit E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens per row
for one target forward over rows x (k+1) tokens plus the draft's own work.
The controller maximises tokens per second, E(k) * rows / (verify(rows*(k+1)) +
draft(k)), and turns speculation off (k = 0) when no k beats plain decoding.
At small batches a verify forward costs about what a decode step does and
speculation wins; at large batches the target is compute-bound, verification
is no longer free, and k shrinks or goes to 0.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class VerifyCostModel:
    """Seconds per target forward as a function of tokens in it (rows x tokens).

    Calibrated on this machine by timing real forwards at a ladder of sizes, then
    refined online by the timings of the engine's own forwards (EMA per size).
    """

    def __init__(self, ema: float = 0.3):
        self.points: dict[int, float] = {}
        self.ema = ema

    def calibrate(self, forward: Callable[[int, int], None], rows: int, max_tokens: int, repeats: int = 2) -> None:
        """forward(rows, tokens_per_row) runs one target forward of that shape."""
        for t in sorted({1, 2, 3, 5, max_tokens} & set(range(1, max_tokens + 1))):
            n = rows * t
            if n in self.points:
                continue
            forward(rows, t)  # warm-up of this shape
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                forward(rows, t)
                best = min(best, time.perf_counter() - start)
            self.points[n] = best

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.points.get(tokens)
        self.points[tokens] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds

    def __call__(self, tokens: int) -> float:
        xs = sorted(self.points)
        assert xs, "cost model used before calibration"
        i = bisect.bisect_left(xs, tokens)
        if i < len(xs) and xs[i] == tokens:
            return self.points[tokens]
        if i == 0:
            return self.points[xs[0]] * tokens / xs[0] if tokens > xs[0] else self.points[xs[0]]
        if i == len(xs):  # beyond the ladder: extend linearly from the last two points (or proportionally)
            x0, x1 = (xs[-2], xs[-1]) if len(xs) > 1 else (0, xs[-1])
            y0 = self.points[x0] if x0 else 0.0
            return self.points[x1] + (tokens - x1) * (self.points[x1] - y0) / (x1 - x0)
        x0, x1 = xs[i - 1], xs[i]
        w = (tokens - x0) / (x1 - x0)
        return (1 - w) * self.points[x0] + w * self.points[x1]


class SpeculationController:
    """Chooses k in [0, max_k] before each verify step.

    Acceptance is tracked per position as an EMA over verify steps, starting
    from an optimistic prior so speculation is tried; while off, it probes
    every `probe_every` steps with a small k so a draft that got better is noticed.
    """

    def __init__(self, max_k: int, prior: float = 0.7, ema: float = 0.1, probe_every: int = 16, probe_k: int = 2,
                 fixed: bool = False):
        self.max_k = max_k
        self.fixed = fixed  # always max_k; the cost model still learns (for speedup estimates)
        self.accept = [prior] * max_k  # a_i, conditional acceptance at position i
        self.ema = ema
        self.probe_every, self.probe_k = probe_every, probe_k
        self.cost = VerifyCostModel()
        self.draft_cost_per_token = 0.0
        self.steps_off = 0
        self.last_predicted_speedup = 1.0

    def expected_tokens(self, k: int) -> float:
        total, alive = 1.0, 1.0
        for a in self.accept[:k]:
            alive *= a
            total += alive
        return total

    def tokens_per_second(self, rows: int, k: int) -> float:
        seconds = self.cost(rows * (k + 1)) + k * self.draft_cost_per_token
        return rows * self.expected_tokens(k) / seconds

    def choose(self, rows: int) -> int:
        if self.fixed:
            return self.max_k
        rates = [self.tokens_per_second(rows, k) for k in range(self.max_k + 1)]
        best = max(range(self.max_k + 1), key=rates.__getitem__)
        self.last_predicted_speedup = rates[best] / rates[0]
        if best == 0:
            self.steps_off += 1
            if self.steps_off % self.probe_every == 0:
                return min(self.probe_k, self.max_k)
            return 0
        self.steps_off = 0
        return best

    def observe(
        self, k: int, reached: list[int], accepted: list[int], rows: int, verify_s: float, draft_s: float
    ) -> None:
        """reached[i]/accepted[i]: rows for which draft position i was in play / accepted."""
        for i in range(min(k, self.max_k)):
            if reached[i]:
                rate = accepted[i] / reached[i]
                self.accept[i] = (1 - self.ema) * self.accept[i] + self.ema * rate
        self.cost.observe(rows * (k + 1), verify_s)
        if k:
            per_token = draft_s / k
            self.draft_cost_per_token = 0.8 * self.draft_cost_per_token + 0.2 * per_token
