"""The trained draft against the run's initial draft on the same batches (rl.frozen_draft_every).

The frozen control of `bench e2e` is a run of its own: its sampled answers part ways with the co-trained run's
from the first step, so its policy moves elsewhere (in stop 41's sitting the two reached drift 0.37 and 0.14) and its
controller chooses other k. A co-trained run that also scores its initial draft, never updated, on each
measured step's batch compares the two drafts on the same tokens of the same policy: the per-step difference of
their expected acceptance (the draft losses' `expected_accept*` metrics: sum_v min(p, q) at T=1, p the policy's
row over the draft's vocabulary, on the tokens the loss scores; TTT step s for EAGLE-3's draft position s) is what
co-training bought, measured by one definition for both drafts.
"""

from __future__ import annotations

import math
import re
import statistics

from codraft.bench.report import markdown_table

PREFIX = "frozen_draft/"
KEY = re.compile(r"expected_accept(_pos_\d+)?$")  # EAGLE-3: one per TTT step; DFlash / DSpark: over the block


def paired_rows(history: dict[str, list[dict]]) -> list[dict]:
    """Per run that scored its initial draft and per expected-acceptance metric: the means of the trained and the
    initial draft over the measured steps of the run's second half, and of their per-step difference with its SE."""
    out = []
    for name, rows in history.items():
        scored = [r for r in rows if any(k.startswith(PREFIX) for k in r)]
        if not scored:
            continue
        half = rows[-1]["step"] / 2
        picked = [r for r in scored if r["step"] > half]
        keys = sorted(k.removeprefix(PREFIX) for k in scored[-1] if k.startswith(PREFIX) and KEY.search(k))
        for key in keys:
            paired = [r for r in picked if _finite(r.get(f"draft/{key}")) and _finite(r.get(PREFIX + key))]
            trained = [r[f"draft/{key}"] for r in paired]
            frozen = [r[PREFIX + key] for r in paired]
            gain = [a - b for a, b in zip(trained, frozen, strict=True)]
            se = statistics.stdev(gain) / math.sqrt(len(gain)) if len(gain) >= 2 else None
            out.append({"run": name, "metric": key, "steps": [r["step"] for r in paired],
                        "trained": statistics.fmean(trained) if paired else math.nan,
                        "initial": statistics.fmean(frozen) if paired else math.nan,
                        "gain": statistics.fmean(gain) if paired else math.nan, "gain_se": se})
    return out


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def paired_table(rows: list[dict]) -> str:
    header = ["run", "metric", "steps", "trained draft", "initial draft", "trained - initial ± SE"]
    body = [[r["run"], r["metric"], len(r["steps"]), r["trained"], r["initial"],
             f"{r['gain']:.3f}" + ("" if r["gain_se"] is None else f" ± {r['gain_se']:.3f}")] for r in rows]
    note = ("Trained vs initial draft on the same batches (rl.frozen_draft_every): each co-trained run also scored "
            "its initial draft, never updated, on the steps' training batches, the trained draft's metric taken "
            "before that step's update (so on tokens it had not trained on). Expected acceptance = the draft loss's "
            "mean over its scored tokens of sum min(p, q) at T=1 (p: the policy's row over the draft vocabulary), "
            "per TTT step for EAGLE-3; means over the scored steps of the run's second half; SE of the per-step "
            "differences.")
    return markdown_table(header, body) + "\n" + note + "\n"
