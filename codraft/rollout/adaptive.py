"""Adaptive speculation: pick k per verify step from acceptance and measured cost.

With per-position conditional acceptance a_i = P(draft i accepted | draft i-1
accepted), k drafts emit E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens per row
for one target forward of rows x (k+1) tokens plus the draft's own work. The
controller maximises tokens per second, E(k) * rows / (verify(rows, k+1) +
draft(k)), and turns speculation off (k = 0) when no k beats plain decoding by
`min_gain` (5%): near break-even the model's error decides, and wrong calls there
only lose. In a batch, E(k) is the rows' mean, but the batch runs until its last
row is done: rows accept by chance, so the slowest of n similar rows needs about
1 + z(n) cv / sqrt(S) times the mean's S steps (`tail`), and the rate is priced
at that pace. At batch 8 on 48 tokens that is 6-14%, as much as a step's whole
predicted gain there. Rows also differ by more than chance (one copies a long list,
another is past its answer), and with known lengths the rows that accept well finish
first: such a call is priced whole (`call_seconds`), each row at its own pace
(row_pace.py), the steps after a row finished at the cost of the rows left. Where a
step costs about the same at any row count (a CPU at a few rows) the call is then
as long as its slowest row; where it costs by the row, the rows done early make the
rest cheaper.

Everything is learned from the engine's own steps, so the controller costs
nothing up front (no calibration forwards): the first two steps of a fresh
controller decode plainly, which times a decode step (the first call of a shape
pays one-off costs, so a shape's first timing only stands until its second);
acceptance starts from a weak prior (0.3, worth one observation) that only ever
buys a probe, so a useless draft is found out in a step; while off, probes come
at growing intervals (8, 16, ... 64 steps) and at the start of every generate
call, so a draft that got better is noticed at a bounded cost; a call that follows
one which ended off (on its hardest text: rows past their answers) starts from that
call's acceptance over all its steps (`new_batch`). A probe drafts
max_k tokens on its first `probe_rows` rows only (the others ride in its forward
at the cost of decoding): it samples acceptance at every position, and where
the batch has no more rows than that it times the longest verify shape, whose
cost per token a 2-token forward misstates (at batch 1 on a CPU a 5-token
forward can cost what a 2-token one does). While on, one
step in 32 decodes plainly to keep the decode cost it compares against fresh, and while on at a k
shorter than a probe's, one step in 32 is a probe, which reads the positions past k that its steps never reach.
A proposal that first absorbs a backlog (the prompt, or the tokens committed
while speculation was off) says nothing about the steady per-step draft cost,
so its time is not learned from; until one is, drafting is priced at 5% of a
decode step per token. Where no forward of several tokens per row was timed at
the batch's row count (or more), the first speculative step is k = 1: the
cheapest shape, whose timing then prices the others.

Until stop 40 what the per-step model leaves out was audited once per generate call (the call's seconds against
plain decoding's by the measured decode costs, the shortfall against the model's predicted saving charged as a
per-step overhead per batch size). With shape costs as medians (one stall no longer prices a shape) and the last
row's pace priced per step (`tail`), that audit mostly charged its own noise: in GRPO-like rollouts (1 prompt x 4
samples, T=1, stop tokens on, 192 tokens; 10 interleaved calls each against plain decoding of the same rows to the
same lengths) adaptive ran 1.34x plain decoding with it and 1.42x without (fixed k = 3: 1.44x), and `bench draft`
and `bench rollout` without it read the same or better in every cell but noise (README, stop 40).

A chain draft (EAGLE-3: one token per draft forward) in a greedy call ends each proposal where its own
confidence says the next draft no longer pays (`stop_rule`, calibration.DraftStop), so a step is on at max_k or
off, and its depth follows the text: an answer's copied numbers draft deep, what follows it stops after one. The
drafts it did not make count as rejected, so acceptance and the measured cost of a step of max_k price that rule.
At batch 1 on the chain task (stop tokens off, 48 tokens, 16 prompts, medians of 3 interleaved rounds) it ran
1.42x plain decoding where one k per step ran 1.40x and fixed k = 2 / 3 1.36x / 1.39x. Sampled calls keep one k
per step: a sampled draft's probability of its own token says little of whether p/q passes.

With `truncate` on (off by default), after each proposal `verify_lengths` cuts each row's drafts at the first
whose calibrated acceptance (calibration.py) does not pay for its share of the verify forward, where the cut
forward's measured cost makes that pay, and the forward runs only the tokens fed. Greedy calls only, as the
chain's stop rule: a cut that reads a sampled draft's own probability changes the distribution it was drawn from
(the engine passes no confidence at T > 0).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable
from statistics import NormalDist

import torch

from codraft.rollout.calibration import DraftCalibration, DraftStop
from codraft.rollout.row_pace import RowPace

SEGMENTS = 4  # groups of rows that `call_seconds` prices as finishing together: four cost lookups per k at any batch


def nearest_rows(counts: Iterable[int], rows: int) -> int:
    """The row count among `counts` nearest to `rows`, the larger of two as near (it errs towards a higher cost)."""
    return min(counts, key=lambda r: (abs(r - rows), -r))


class VerifyCostModel:
    """Seconds of a target forward of `rows` rows x `tokens` tokens per row: the median of its last `window`
    observed forwards. A mean lets one slow forward (this shared machine stalls now and then) price its shape
    until it is observed again, and a shape priced too high is not chosen, so not observed: a 77 ms spike of a
    ~48 ms shape kept k = 4 off through the rest of a run (a trace at batch 4, T=1), and a decode step timed
    69 ms at 2 rows (32-40 ms at 1-4) made every verify there look cheaper than decoding.

    Keyed on the real shape, not on rows x tokens: at the same product, a forward of many rows reads
    more KV cache than one of few rows with more tokens each. A forward whose rows ran different numbers of
    tokens (drafts cut or never proposed) is keyed by its mean tokens per row, to a quarter token: its linears
    run on all its tokens at once. An unobserved shape is the decode cost at those rows (interpolated between observed
    row counts) times the verify/decode ratio at the nearest row count that has both, interpolated between the
    observed token counts around it (else extended through the nearest), else `prior_extra` per extra token.
    """

    def __init__(self, window: int = 5, prior_extra: float = 0.2):
        self.points: dict[float, dict[int, float]] = {}  # tokens per row -> {rows: seconds}
        self.seen: dict[tuple[int, float], int] = {}  # (rows, tokens) -> observations
        self.recent: dict[tuple[int, float], deque[float]] = {}  # (rows, tokens) -> its last `window` seconds
        self.window, self.prior_extra = window, prior_extra
        self._ratios: dict[int, dict[float, float]] = {}  # rows -> {tokens: cost / decode cost}, until the next observe

    def observe(self, rows: int, tokens: float, seconds: float) -> None:
        # mean tokens per row to a quarter token: exact fractions made thousands of keys at batch 32, and pricing
        # a step took 25 ms where 29 keys take 1
        tokens = round(4 * tokens) / 4
        self._ratios.clear()
        n = self.seen[rows, tokens] = self.seen.get((rows, tokens), 0) + 1
        recent = self.recent.setdefault((rows, tokens), deque(maxlen=self.window))
        if n == 2:  # a shape's first forward pays one-off costs (kernel selection, allocation): the second replaces it
            recent.clear()
        recent.append(seconds)
        self.points.setdefault(tokens, {})[rows] = statistics.median(recent)

    def known(self) -> bool:
        """A decode step was timed twice at some row count (its first timing alone is not trusted)."""
        return any(self.seen.get((rows, 1), 0) >= 2 for rows in self.points.get(1, {}))

    def _at_rows(self, tokens: float, rows: int) -> float | None:
        """Cost of `tokens` per row at `rows`, interpolated over observed row counts (flat below the
        smallest, proportional above the largest: both err towards a higher cost)."""
        by_rows = self.points.get(tokens)
        if not by_rows:
            return None
        xs = sorted(by_rows)
        i = bisect.bisect_left(xs, rows)
        if i < len(xs) and xs[i] == rows:
            return by_rows[rows]
        if i == 0:
            return by_rows[xs[0]]
        if i == len(xs):
            return by_rows[xs[-1]] * rows / xs[-1]
        r0, r1 = xs[i - 1], xs[i]
        w = (rows - r0) / (r1 - r0)
        return (1 - w) * by_rows[r0] + w * by_rows[r1]

    def _ratio(self, tokens: float, rows: int) -> float:
        """cost(tokens) / cost(1), each observed token count's ratio taken at its row count nearest to `rows`
        (where it and a decode step were both timed); between two observed token counts, interpolated; past
        them, extended linearly from (1, 1) through the nearest."""
        ratios = self._ratios.get(rows)
        if ratios is None:
            ratios = self._ratios[rows] = {}
            for t, by_rows in self.points.items():
                common = set(by_rows) & set(self.points[1]) if t > 1 else ()
                if common:
                    near = nearest_rows(common, rows)
                    ratios[t] = by_rows[near] / self.points[1][near]
        if not ratios:
            return 1 + self.prior_extra * (tokens - 1)
        below = max((t for t in ratios if t <= tokens), default=None)
        above = min((t for t in ratios if t >= tokens), default=None)
        if below is not None and above is not None:
            if above == below:
                return ratios[below]
            w = (tokens - below) / (above - below)
            return (1 - w) * ratios[below] + w * ratios[above]
        t = below if above is None else above
        return 1 + (ratios[t] - 1) * (tokens - 1) / (t - 1)

    def verify_timed(self, rows: int) -> bool:
        """A forward of more than one token per row was timed at `rows` rows or more (where the cost per extra token
        is at least what it is at `rows`)."""
        return any(r >= rows for t, by_rows in self.points.items() if t > 1 for r in by_rows)

    def __call__(self, rows: int, tokens: float) -> float:
        assert 1 in self.points, "cost model used before any decode step was observed"
        decode = self._at_rows(1, rows)
        if tokens == 1:
            return decode
        if rows in self.points.get(tokens, {}):
            return self.points[tokens][rows]
        return decode * self._ratio(tokens, rows)


def update_ema(table: dict, key, value: float, weight: float = 0.3) -> None:
    """table[key] moves `weight` of the way to `value` (starts there)."""
    old = table.get(key)
    table[key] = value if old is None else (1 - weight) * old + weight * value


def laggard_z(n: int) -> float:
    """E[max of n standard normals], Blom's approximation (1.03 / 1.42 / 2.04 for 4 / 8 / 32; 0 for one)."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


class SpeculationController:
    """Chooses k in [0, max_k] before each verify step; keep one across generate calls to keep what it learned."""

    def __init__(self, max_k: int, prior: float = 0.3, prior_weight: float = 1.0, memory: float = 32.0,
                 probe_k: int | None = None, probe_rows: int = 4, first_probe: int = 8, max_probe_interval: int = 64,
                 min_gain: float = 0.05, refresh_every: int = 32, truncate: bool = False, draft_prior: float = 0.05,
                 probe_budget: float = 0.02, draft_stop: bool = True):
        if probe_rows < 1:
            raise ValueError(f"probe_rows must be >= 1 (the rows whose drafts a probe verifies), got {probe_rows}")
        self.max_k = max_k
        self.min_gain = min_gain  # speculate only when the predicted rate beats plain decoding by this share
        # each position's estimate averages about the last `memory` row observations, whatever the batch: rows
        # move into text the draft predicts worse (past an answer) within a few steps, and a per-step decay
        # kept batch 8 speculating on the acceptance of the answers for ~50 steps into what followed them
        self.prior, self.prior_weight, self.memory = prior, prior_weight, memory
        self.hits = [0.0] * max_k  # discounted accepted counts per position
        self.trials = [0.0] * max_k  # discounted reached counts per position
        # the same over all of the current call's steps, undiscounted: where the next call may start (new_batch)
        self.call_hits = [0.0] * max_k
        self.call_trials = [0.0] * max_k
        self.cost = VerifyCostModel()
        self.draft_s: dict[int, float] = {}  # k -> EMA of the draft's seconds for one proposal
        # until a steady proposal is timed, a drafted token costs this share of a decode step (issue 11's budget for
        # EAGLE-3; measured 3-5% here). Priced at 0, drafting looked free to a batch whose probes sample some of its
        # rows (they teach no draft cost) until one speculative step followed another
        self.draft_prior = draft_prior
        # a probe of one draft token priced longer drafts by the 2-token forward's cost: at batch 1 here that is the
        # dearest per token (1.10 decode steps against 0.96 for 5 tokens), and n-gram drafts that paid 1.25x at k=4
        # stayed off after one probe. None: max_k
        self.probe_k = max_k if probe_k is None else probe_k
        self.first_probe, self.max_probe_interval = first_probe, max_probe_interval
        # a probe verifies the drafts of its first `probe_rows` rows only: a sample of acceptance needs no more,
        # and at batch 32 verifying all 32 rows' drafts cost a probe 0.41 decode steps against 0.12 for 4 rows
        self.probe_rows = probe_rows
        self.steps_off, self.probe_interval = 0, first_probe
        # the decode cost is the yardstick of every choice: while speculating, a plain step re-times it once in
        # `refresh_every` steps at each row count (and at a row count never decoded at), else it would stay what
        # the first steps measured
        self.refresh_every = refresh_every
        self.since_decode: dict[int, int] = {}  # rows -> verify steps since the last plain one at those rows
        # rows -> verify steps of fewer than probe_k drafts since one of probe_k. A step of k never reaches the
        # positions past k, so one rejected draft at position 2 (a call's first probe) held its estimate at 0.15 and
        # a batch-1 run at T=1 at k = 1 for 115 of 121 steps, 1.35x plain decoding where fixed k = 7 ran 1.57x (stop
        # 62): while on at a shorter k, one step in `refresh_every` at each row count is a probe of probe_k
        self.since_deep: dict[int, int] = {}
        self.probing = False  # the last choice was a probe: it samples acceptance, so it should cost little
        self.off = False  # the last choice was off or a probe (a plain step that re-times decode counts as on)
        # rows -> a probe's seconds beyond a plain step, in decode steps (EMA). At batch 32 a probe's 36-row forward
        # reads the bf16 weights twice and its draft absorbs 4 prompts: with three probes in a 47-step call and no
        # other speculation, a call took 1.06x plain decoding's time (in-process A/B). Probes come at most once in
        # probe_cost / probe_budget steps off, the start of a call included
        self.probe_cost: dict[int, float] = {}
        self.probe_budget = probe_budget
        # per-row draft lengths: a row's drafts past the first one not worth its share of the verify forward
        # are not fed (the forward then runs only the tokens fed); one speculative step in `refresh_every` at
        # each row count feeds them all, which keeps the untruncated cost and the calibration's low buckets fresh.
        # Off by default: a cut draft counts as rejected, so cuts lower the acceptance estimate, and the per-call
        # audit (removed at stop 40) charged the shortfall as overhead; in GRPO-like rollouts (1 prompt x 4
        # samples, T=1, stop tokens on, 192 tokens, the e2e bench's) plain time / adaptive time read 1.06-1.30
        # with cuts and 1.34-1.40 without, against 1.39-1.47 for fixed k = 3 (medians of 8-12 calls, four
        # interleaved runs); at batch 1-32 they were within noise of no cuts (README, stop 24)
        self.truncate = truncate
        self.by_stop = False  # the current call's drafter stops early by `stop_rule` (new_batch)
        # a chain draft ends its proposal once its next draft no longer pays (`stop_rule`): k is then the most it
        # may draft, and the drafts it did not make count as rejected, so acceptance and cost per k price the rule
        self.draft_stop = draft_stop
        self.stop: DraftStop | None = None  # the rule of the current step
        self.position_s: dict[int, float] = {}  # rows -> EMA of one more draft position's seconds (DraftStop)
        self.calibration = DraftCalibration()
        self.verified: dict[int, float] = {}  # k -> EMA of the drafts per row a step of k verified
        self.since_full: dict[int, int] = {}  # rows -> steps since the last untruncated one
        self.row_pace = RowPace()  # each live row's acceptance against the estimate's (`call_seconds`)

    def new_batch(self, rows: int, stops_early: bool = False) -> None:
        """A generate call of `rows` rows starts: new prompts (and, in training, an updated draft) may accept
        differently, so if speculation is off its next step is a probe, unless the last one was too recent for
        the probe budget at this batch size. `stops_early`: the drafter ends a proposal where `stop_rule` says.

        A call that ended with speculation off ended on its hardest text (rows past their answers), and an
        acceptance estimate frozen there kept speculation off into the next call's fresh answers until a probe was
        due (EAGLE-3 at batch 4, T=1: off for 90 of ~160 steps, 1.03x plain decoding where fixed k = 2 ran 1.22x).
        So after such a call acceptance starts from that call's acceptance over all its steps, weighted as at most
        `memory` observations: a draft that stopped being accepted is not revived by an older history (its last
        call's average already holds what it missed), while one that met hard text at the end of good answers
        starts the next call on. After a call that ended speculating the estimate stays as it is: starting every
        call from a longer history held the positions a short k never reaches at their older, lower rates (batch 1,
        T=1: k = 2 for 96 steps, 1.47x, where the estimate as it was ran k = 3 at 1.59x)."""
        self.by_stop = self.draft_stop and stops_early
        if self.off:
            for i, n in enumerate(self.call_trials):
                if n:
                    weight = min(1.0, self.memory / n)
                    self.hits[i], self.trials[i] = weight * self.call_hits[i], weight * n
        self.call_hits, self.call_trials = [0.0] * self.max_k, [0.0] * self.max_k
        self.row_pace.start(rows)
        if self.steps_off >= self.probe_wait(rows):
            self.steps_off = max(self.steps_off, self.probe_interval - 1)

    @property
    def accept(self) -> list[float]:
        """a_i, the conditional acceptance estimate at each draft position."""
        w = self.prior_weight
        return [(h + self.prior * w) / (n + w) for h, n in zip(self.hits, self.trials, strict=True)]

    def emitted_moments(self, k: int) -> tuple[float, float]:
        """Mean and variance of the tokens a row emits in a step of k drafts (1 + the accepted run's length)."""
        mean, square, alive = 1.0, 1.0, 1.0
        for j, a in enumerate(self.accept[:k], start=1):
            alive *= a  # P(at least j drafts accepted)
            mean += alive
            square += (2 * j + 1) * alive  # E[e^2] = sum over m >= 1 of (2m - 1) P(e >= m)
        return mean, square - mean * mean

    def expected_tokens(self, k: int) -> float:
        return self.emitted_moments(k)[0]

    def observe_rows(self, k: int, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """A step of k's rows, before `observe` learns from it: verified [B] (the row had drafts verified) and
        accepted [B] drafts each, against the E(k) - 1 its choice expected."""
        self.row_pace.observe(verified, accepted, self.expected_tokens(k) - 1)

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Only rows `keep` (indices into the live rows) go on, in that order (the engine's compaction)."""
        self.row_pace.keep(keep)

    def tail(self, k: int, remaining: list[int] | None) -> float:
        """How much longer than its rows' mean progress a batch's speculation runs: rows accept by chance, and the
        batch decodes until its last row is done, while plain decoding moves every row a token a step. The row
        furthest behind needs S = lead / E steps, and among the n rows whose remaining tokens are within one
        standard deviation of a row's progress over S steps (sd sqrt(S)) of it, the slowest takes about
        z(n) sd sqrt(S) tokens more: a factor 1 + z(n) cv / sqrt(S) on the steps. At batch 8 and 48 tokens with
        EAGLE-3's sampled acceptance that is 1.06-1.14 (k = 1-4), as much as the per-step model's whole predicted
        gain there; unpriced, the per-call audit (stop 38) had to learn it call by call, and batch 8 lost 7% at T=1.
        `remaining`: each live row's tokens still allowed, where that is its length (no stop tokens); None: rows
        end at stop tokens, their lengths differ more than their progress, and the call's end is its longest row
        (no tail)."""
        if not k or not remaining:
            return 1.0
        mean, var = self.emitted_moments(k)
        lead = max(remaining)
        steps = max(lead / mean, 1.0)
        spread = math.sqrt(var * steps)  # sd of a row's tokens over those steps
        contenders = sum(1 for r in remaining if r >= lead - spread)
        return 1 + laggard_z(contenders) * spread / (mean * steps)

    def draft_cost(self, k: int, rows: int) -> float:
        """Seconds of one proposal of k tokens: observed, else the nearest observed k scaled by k, else (no steady
        proposal timed yet: a batch whose probes sample some of its rows) `draft_prior` decode steps per token."""
        if k in self.draft_s:
            return self.draft_s[k]
        if not self.draft_s:
            return self.draft_prior * k * self.cost(rows, 1)
        near = min(self.draft_s, key=lambda j: abs(j - k))
        return self.draft_s[near] * k / near

    def step_seconds(self, rows: int, k: int) -> float:
        if not k:
            return self.cost(rows, 1)
        return self.cost(rows, 1 + self.verified_drafts(k)) + self.draft_cost(k, rows)

    def verified_drafts(self, k: int) -> float:
        """Drafts per row a step of k verifies: observed, else k times the share verified at the nearest observed k."""
        if k in self.verified or not self.verified:
            return self.verified.get(k, k)
        near = min(self.verified, key=lambda j: abs(j - k))
        return k * self.verified[near] / near

    def token_threshold(self, rows: int, k: int) -> float:
        """The acceptance at which one more verified draft per row pays for itself: its share of the untruncated
        verify forward's extra cost, in decode steps per row, since plain decoding makes a token per row and step."""
        return (self.cost(rows, k + 1) / self.cost(rows, 1) - 1) / k

    def verify_lengths(self, rows: int, k: int, lengths: torch.Tensor, confidence: torch.Tensor | None
                       ) -> torch.Tensor:
        """How many of each row's drafts to verify (at most `lengths`): those whose calibrated acceptance, with the
        drafts before them, reaches `token_threshold` (all, without a confidence). A probe verifies all drafts of
        its first `probe_rows` rows and none of the others; one step in `refresh_every` at each row count verifies
        all."""
        if self.probing:
            sampled = lengths.clone()
            sampled[self.probe_rows:] = 0
            return sampled
        if not self.truncate or confidence is None:
            return lengths
        since = self.since_full[rows] = self.since_full.get(rows, self.refresh_every - 1) + 1
        if since >= self.refresh_every:
            self.since_full[rows] = 0
            return lengths
        acceptance = self.calibration(confidence)
        worth = acceptance >= self.token_threshold(rows, k)
        cut = torch.minimum(lengths, worth.long().cumprod(-1).sum(-1))
        return cut if self.cut_pays(rows, acceptance, lengths, cut) else lengths

    def stop_rule(self, rows: int, k: int) -> DraftStop | None:
        """When a chain draft of at most k tokens for `rows` rows stops early; None drafts all k (a probe samples
        every position; the rule is off; no decode step timed yet). One more draft position costs a draft forward
        (timed by the rule itself, else `draft_prior` decode steps) and a token per row in the verify forward;
        each accepted draft saves a row's share of a decode step."""
        self.stop = None
        if not self.draft_stop or self.probing or k < 2 or not self.cost.known():
            return None
        decode = self.cost(rows, 1)
        depth = max(self.verified_drafts(k), 1.0)  # drafts per row its steps verify: the verify forward's width
        position = self.position_s.get(rows, self.draft_prior * decode) + (self.cost(rows, 1 + depth) - decode) / depth
        self.stop = DraftStop(self.calibration, rows * position / decode)
        return self.stop

    def observe_drafts(self, confidence: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """A verify step's drafts: each row's confidences [B, k], drafts verified and accepted [B]. Only per-row cuts
        and the current call's draft stops read the calibration, so without them nothing is learned (no per-step
        work on the decode loop)."""
        if self.truncate or self.by_stop:
            self.calibration.observe(confidence, verified, accepted)

    def cut_pays(self, rows: int, acceptance: torch.Tensor, lengths: torch.Tensor, cut: torch.Tensor) -> bool:
        """Whether verifying `cut` drafts per row (of `lengths`) emits more tokens per second than verifying all,
        priced by the measured cost of forwards of the two mean token counts per row. A cut that leaves rows
        ragged runs a forward whose tokens are gathered and scattered around every layer's attention, which at a
        few rows on a CPU costs what the whole forward does (SmolLM2, batch 4: 10 of 16 tokens 1.21 decode steps,
        all 16 1.21), so there a cut loses the drafts it drops and saves nothing."""
        def rate(verified: torch.Tensor) -> float:
            kept = torch.arange(acceptance.shape[-1], device=acceptance.device) < verified[:, None]
            tokens = rows + float((acceptance * kept).sum())
            return tokens / self.cost(rows, 1 + round(4 * float(verified.float().mean())) / 4)

        return bool((cut < lengths).any()) and rate(cut) > rate(lengths)

    def call_seconds(self, k: int, remaining: list[int]) -> float:
        """Seconds to decode the `remaining` tokens of each live row with steps of k: a row emits
        1 + r (E(k) - 1) tokens a step, r its accepted drafts over those expected (row_pace.py; 1 for rows it does
        not track), and while some rows are done the step costs what it costs at the rows left (in at most
        SEGMENTS groups of rows finishing together, each priced at the rows live when it starts), times the chance
        tail of the last row (`tail`). Priced by the rows' mean, lists at batch 4, T=0 (48 tokens, stop tokens off,
        the default run's warm start) ran 0.937-0.969x plain decoding in three sittings, priced so 0.966-1.012x
        (0.987x with the pace's defaults, where the chain task at batch 4, T=1 ran 1.172x against the mean's 1.182x;
        in-process A/Bs, medians of 5-6 rounds; one `bench draft` run read 0.889x on that lists cell, results/LOG.md
        stop 56)."""
        rows = len(remaining)
        drafts = self.expected_tokens(k) - 1 if k else 0.0
        ratios = self.row_pace.ratios() if k and self.row_pace.rows() == rows else [1.0] * rows
        steps = sorted(left / (1 + r * drafts) for left, r in zip(remaining, ratios, strict=True))
        stride = -(-rows // SEGMENTS)
        seconds, done = 0.0, 0.0
        for first in range(0, rows, stride):
            end = steps[min(first + stride, rows) - 1]
            seconds += (end - done) * self.step_seconds(rows - first, k)
            done = end
        return seconds * self.tail(k, remaining)

    def tokens_per_second(self, rows: int, k: int, remaining: list[int] | None = None) -> float:
        """Tokens per second of steps of k: with known lengths in a call of several rows, over the whole call
        (`call_seconds`; also for its last row); else a step's, at the pace of the batch's last row (`tail`)."""
        if remaining and self.row_pace.batch > 1:
            return sum(remaining) / self.call_seconds(k, remaining)
        return rows * self.expected_tokens(k) / self.tail(k, remaining) / self.step_seconds(rows, k)

    def choose(self, rows: int, remaining: list[int] | None = None) -> int:
        """k for the next step of `rows` live rows; `remaining`: each one's tokens still allowed (`tail`)."""
        self.probing = False
        if not self.cost.known():
            return 0  # the first steps decode plainly and so time a decode step
        # until a forward of several tokens per row was timed at these rows (or more), the first full step is the
        # cheapest one: the others' prior is a guess (a batch-32 verify of 4 tokens priced 1.6x a decode step
        # from the prior cost 2.4x, in a step chosen right after a probe)
        most = self.max_k if self.cost.verify_timed(rows) else min(1, self.max_k)
        # where the draft's own confidence ends each proposal (`stop_rule`), a step is on (drafting up to max_k) or
        # off: its depth follows the text, where one k per step is the depth that pays on average
        choices = [0, most] if self.by_stop else range(most + 1)
        rates = {k: self.tokens_per_second(rows, k, remaining) for k in choices}
        best = max(choices, key=rates.__getitem__)
        if rates[best] < (1 + self.min_gain) * rates[0]:  # a predicted gain within the model's error is no gain
            best = 0
        self.off = not (best and self.trials[0])
        if not self.off:
            self.steps_off, self.probe_interval = 0, self.first_probe
            if self.since_decode.get(rows, self.refresh_every) >= self.refresh_every:
                return 0
            if best < self.probe_k and self.since_deep.get(rows, 0) >= self.refresh_every:
                self.probing = True  # the positions past a short k, which its steps never reach
                return self.probe_k
            return best
        # off, or on by the prior alone (no acceptance observed yet), which is only worth a probe
        self.steps_off += 1
        if not best and self.steps_off < max(self.probe_interval, self.probe_wait(rows)):
            return 0
        self.steps_off = 0
        self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
        self.probing = True
        return min(self.probe_k, self.max_k)

    def samples_all(self, rows: int) -> bool:
        """The last choice drafts for all `rows` rows: not a probe of its first `probe_rows` rows only, whose draft
        time and drafts per row are not a step's."""
        return not self.probing or self.probe_rows >= rows

    def probe_wait(self, rows: int) -> float:
        """Steps off between probes at `rows` that keep their measured extra cost within `probe_budget` of the
        plain steps' time. A row count never probed at is priced at the nearest one that was: rows leave a batch
        one by one, and unpriced (free) counts let a batch-32 call probe again at 31, 30, 27 rows within its 47
        steps, each probe 1.1-1.8 decode steps (a trace, T=1, stop tokens off)."""
        if not self.probe_cost:
            return 0.0
        return self.probe_cost[nearest_rows(self.probe_cost, rows)] / self.probe_budget

    def observe_probe(self, rows: int, seconds: float) -> None:
        """A probe's draft and verify took `seconds` (its proposal's backlog included: that is what it cost)."""
        extra = max(seconds / self.cost(rows, 1) - 1, 0.0) if self.cost.known() else 0.0
        update_ema(self.probe_cost, rows, extra)

    def observe(self, k: int, reached: list[int], accepted: list[int], rows: int, verify_s: float,
                draft_s: float | None, fed: int | None = None) -> None:
        """reached[i]/accepted[i]: rows for which draft position i was in play / accepted. draft_s: seconds of
        the proposal, None when it absorbed a backlog (its time is not the steady cost of drafting). fed: tokens
        the verify forward ran (default: all rows x (k + 1)), which key its time in the cost model per row."""
        for i in range(min(k, self.max_k)):
            fade = min(1.0, self.memory / (self.trials[i] + reached[i])) if reached[i] else 1.0
            self.hits[i] = fade * (self.hits[i] + accepted[i])
            self.trials[i] = fade * (self.trials[i] + reached[i])
            self.call_hits[i] += accepted[i]
            self.call_trials[i] += reached[i]
        fed = rows * (k + 1) if fed is None else fed
        # ragged forwards too. Priced from whole shapes only, the n-gram drafter's steps at batch 8 (rows with and
        # without drafts) never re-timed a multi-token forward: one 2-token forward's 51.2 ms stood against a decode
        # cost that drifted 40.8 -> 48.7 ms, a ratio of 1.25 read as 1.05 (a trace), and bench rollout's adaptive
        # n-gram ran k=4 at batch 8 at 0.93x plain decoding
        self.cost.observe(rows, fed / rows, verify_s)
        # a probe of fewer rows verifies few drafts per row: learned from, a batch-32 probe of k = 7 said a step of k
        # verifies 0.875 drafts per row, a full step of k = 1 was priced as 0.125 drafts per row, and calls at batch
        # 32, T=1, speculated at steps that saved nothing (a trace, stop 59)
        if k and self.samples_all(rows):
            update_ema(self.verified, k, fed / rows - 1)
        self.since_decode[rows] = self.since_decode.get(rows, 0) + 1 if k else 0
        if k:
            self.since_deep[rows] = 0 if k >= self.probe_k else self.since_deep.get(rows, 0) + 1
        if self.stop is not None and self.stop.position_s:  # the marginal seconds of a draft position at these rows
            update_ema(self.position_s, rows, statistics.median(self.stop.position_s))
        self.stop = None
        if k and draft_s is not None:
            update_ema(self.draft_s, k, draft_s)
