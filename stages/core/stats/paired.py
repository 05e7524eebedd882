"""Paired comparison of two models scored on the same items: wins, losses, ties, the accuracy
delta and its 95% interval. Pure Python (evaluate computes them, register decides on them); see
docs/evaluation.md ("Comparing two models").

Two models answering the same n items give pairs (new right?, reference right?). Only the
discordant pairs carry information about the difference: `wins` (new right, reference wrong)
and `losses` (the reverse); delta = (wins - losses) / n is the accuracy difference.

The interval is Tango's score interval for a difference of paired proportions (Tango 1998,
Statistics in Medicine 17:891-908): the set of deltas that the score test for paired data does
not reject at 5%. Why this one and not the alternatives:
  * it is the inversion of McNemar's test: at delta = 0 the score statistic *is* McNemar's
    z = (wins - losses) / sqrt(wins + losses), so the interval excludes 0 exactly when McNemar's
    (uncorrected) test rejects; the decision and the printed interval never disagree;
  * it stays informative when every pair ties (0 wins, 0 losses on 50 items gives about
    +-0.07, not the degenerate [0, 0] that a conditional exact interval or a bootstrap gives), and
    it never leaves [-1, 1] (a Wald interval does, and undercovers on small sets);
  * it is deterministic: no resampling seed decides a promotion.
The exact two-sided McNemar p-value (binomial on the discordant pairs) is reported beside it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def mcnemar_exact_p(wins: int, losses: int) -> float:
    """Two-sided exact McNemar p-value: twice the smaller binomial(wins + losses, 1/2) tail, at most 1."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def _restricted_p21(wins: int, losses: int, n: int, delta: float) -> float:
    """The maximum-likelihood probability of a loss when the true delta is `delta` (the positive root
    of 2n q^2 + B q + C = 0, Tango's eq. for the multinomial likelihood with p_win = q + delta)."""
    a = 2 * n
    b = -wins - losses + (2 * n - wins + losses) * delta
    c = -losses * delta * (1 - delta)
    return (math.sqrt(max(b * b - 4 * a * c, 0.0)) - b) / (2 * a)


def score_statistic(wins: int, losses: int, n: int, delta: float) -> float:
    """Tango's score statistic for H0: delta; positive when the observed delta is above `delta`."""
    q = _restricted_p21(wins, losses, n, delta)
    numerator = wins - losses - n * delta
    variance = n * (2 * q + delta * (1 - delta))
    if variance <= 1e-300:
        return 0.0 if abs(numerator) < 1e-12 else math.copysign(math.inf, numerator)
    return numerator / math.sqrt(variance)


def _solve(f, lo: float, hi: float, iterations: int = 80) -> float:
    """The root of the decreasing function f on [lo, hi] (f(lo) >= 0 >= f(hi)) by bisection."""
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def delta_interval(wins: int, losses: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Tango's score interval for the paired accuracy delta (95% by default)."""
    if n <= 0:
        return (-1.0, 1.0)
    estimate = (wins - losses) / n
    low = -1.0 if score_statistic(wins, losses, n, -1.0) <= z else \
        _solve(lambda d: score_statistic(wins, losses, n, d) - z, -1.0, estimate)
    high = 1.0 if score_statistic(wins, losses, n, 1.0) >= -z else \
        _solve(lambda d: score_statistic(wins, losses, n, d) + z, estimate, 1.0)
    return low, high


def compare(new: list[bool], reference: list[bool]) -> dict:
    """Item-by-item comparison of the new model's correctness with a reference model's on the same items.
    `delta` = new - reference accuracy; `delta_low`/`delta_high` its 95% interval."""
    if len(new) != len(reference):
        raise ValueError(f"paired comparison needs the same items: {len(new)} vs {len(reference)} scored")
    n = len(new)
    wins = sum(1 for a, b in zip(new, reference) if a and not b)
    losses = sum(1 for a, b in zip(new, reference) if b and not a)
    both_right = sum(1 for a, b in zip(new, reference) if a and b)
    low, high = delta_interval(wins, losses, n)
    # a diagnostic, not a measure of ability: of what the reference got right, how much the new model kept
    reference_right = both_right + losses
    return {"n": n, "wins": wins, "losses": losses, "ties": n - wins - losses, "both_right": both_right,
            "delta": (wins - losses) / n if n else 0.0, "delta_low": low, "delta_high": high,
            "p_value": mcnemar_exact_p(wins, losses), "reference_right": reference_right,
            "kept": both_right / reference_right if reference_right else None}


def clears(comparison: dict, margin: float, decide_on: str) -> bool:
    """Whether `new - reference >= -margin`, judged on the point estimate (`estimate`) or on the 95%
    interval's lower bound (`interval`: the data show the drop is at most `margin`)."""
    value = comparison["delta"] if decide_on == "estimate" else comparison["delta_low"]
    return value >= -margin - 1e-12


def describe(comparison: dict, against: str) -> str:
    """`+0.042 [-0.051, +0.135] vs the base model on 24 items (2 wins, 1 loss)`."""
    c = comparison
    return (f"{c['delta']:+.3f} [{c['delta_low']:+.3f}, {c['delta_high']:+.3f}] vs {against} on {c['n']} items "
            f"({c['wins']} win{'s' * (c['wins'] != 1)}, {c['losses']} loss{'es' * (c['losses'] != 1)})")


def read_predictions(folder: str | Path) -> dict[str, list[dict]]:
    """A scored folder's `predictions.jsonl` by eval set ("val" without named sets), in set order."""
    path = Path(folder) / "predictions.jsonl"
    out: dict[str, list[dict]] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                out.setdefault(r.get("set", "val"), []).append(r)
    return out


def compare_sets(mine: dict[str, list[dict]], theirs: dict[str, list[dict]], what: str) -> dict[str, dict | None]:
    """`compare` per set of two scored folders' records; None for a set without per-item records (a
    worker's own counts). The items must be the same, in the same order: records of other items are a
    ValueError naming `what`, never a comparison of different questions."""
    def key(r: dict) -> tuple:  # what was asked, not where the file was (configs may spell its path differently)
        return r["reference"], json.dumps(r["prompt"], sort_keys=True), json.dumps(r.get("choices"))
    out: dict[str, dict | None] = {}
    for name, rows in mine.items():
        other = theirs.get(name, [])
        if not rows or not other:
            out[name] = None
            continue
        if len(rows) != len(other) or any(key(a) != key(b) for a, b in zip(rows, other)):
            raise ValueError(f"{what} was scored on other items of eval set '{name}' ({len(other)} vs {len(rows)})")
        # bf16 and fp32 replies are different measurements (docs/evaluation.md); records from before
        # the precision was recorded say nothing, and are taken as they are
        theirs_in, mine_in = other[0].get("precision"), rows[0].get("precision")
        if theirs_in and mine_in and theirs_in != mine_in:
            raise ValueError(f"{what} was scored in {theirs_in}, this model in {mine_in} (eval set '{name}'): "
                             "a comparison is made in one precision")
        out[name] = compare([bool(r["correct"]) for r in rows], [bool(r["correct"]) for r in other])
    return out
