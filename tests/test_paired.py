"""The paired comparison (stages/core/stats/paired.py) against independent references: statsmodels'
McNemar tests, the restricted maximum likelihood found by scipy's optimizer, the closed form of
the all-ties interval, and the interval's coverage in simulation (fixed seed)."""

import math
import random

import pytest

from stages.core.stats.paired import Z95, _restricted_p21, compare, delta_interval, mcnemar_exact_p, score_statistic

CASES = [(w, lost, n) for n in (1, 5, 24, 50, 200) for w in range(0, n + 1, max(1, n // 6))
         for lost in range(0, n - w + 1, max(1, n // 7))]


@pytest.mark.parametrize("wins, losses, n", CASES)
def test_interval_excludes_zero_exactly_when_mcnemar_rejects(wins, losses, n):
    """Tango's interval is the inversion of the score test, which at delta 0 is McNemar's (uncorrected)."""
    from statsmodels.stats.contingency_tables import mcnemar
    low, high = delta_interval(wins, losses, n)
    assert -1 <= low <= (wins - losses) / n <= high <= 1
    if wins + losses == 0:
        return  # McNemar is undefined; see the all-ties test
    p = mcnemar([[0, wins], [losses, 0]], exact=False, correction=False).pvalue
    if abs(p - 0.05) > 1e-6:
        assert (low > 0 or high < 0) == (p < 0.05), (low, high, p)
    assert mcnemar_exact_p(wins, losses) == pytest.approx(mcnemar([[0, wins], [losses, 0]], exact=True).pvalue,
                                                          abs=1e-12)


@pytest.mark.parametrize("wins, losses, n", [(3, 1, 24), (10, 2, 50), (0, 4, 50), (7, 0, 30), (40, 35, 200)])
def test_the_bounds_solve_the_score_equation_with_the_optimizer_s_likelihood(wins, losses, n):
    """At each bound the score statistic is +-z, with the loss probability maximizing the paired
    multinomial likelihood under that delta (found here by scipy, not by the quadratic)."""
    from scipy.optimize import minimize_scalar
    rest = n - wins - losses
    for delta, target in zip(delta_interval(wins, losses, n), (Z95, -Z95)):
        lo, hi = max(0.0, -delta) + 1e-12, (1 - delta) / 2 - 1e-12

        def nll(q, delta=delta):
            return -(wins * math.log(q + delta) + losses * math.log(q)
                     + rest * math.log(max(1 - 2 * q - delta, 1e-300)))
        q = minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12}).x
        assert _restricted_p21(wins, losses, n, delta) == pytest.approx(q, abs=1e-6)
        z = (wins - losses - n * delta) / math.sqrt(n * (2 * q + delta * (1 - delta)))
        assert z == pytest.approx(target, abs=1e-4)
        assert score_statistic(wins, losses, n, delta) == pytest.approx(target, abs=1e-6)


@pytest.mark.parametrize("n", [10, 50, 200, 1000])
def test_all_ties_give_the_closed_form_width(n):
    """No discordant pair: the interval is +-z^2 / (n + z^2), not the degenerate [0, 0]."""
    half = Z95 ** 2 / (n + Z95 ** 2)
    assert delta_interval(0, 0, n) == pytest.approx((-half, half), abs=1e-9)


def test_coverage_is_near_95_percent():
    """Simulated paired data (fixed seed) with a known delta: the interval holds it about 95% of the time."""
    rng = random.Random(0)
    for n, p_win, p_loss in [(50, 0.10, 0.04), (200, 0.05, 0.05), (24, 0.2, 0.05)]:
        hits = 0
        for _ in range(1500):
            u = [rng.random() for _ in range(n)]
            wins, losses = sum(x < p_win for x in u), sum(p_win <= x < p_win + p_loss for x in u)
            low, high = delta_interval(wins, losses, n)
            hits += low <= p_win - p_loss <= high
        assert 0.925 <= hits / 1500 <= 0.985, (n, hits / 1500)


def test_compare_counts_item_by_item():
    new = [True, True, False, False, True, False]
    ref = [True, False, True, False, False, False]
    c = compare(new, ref)
    assert (c["n"], c["wins"], c["losses"], c["ties"], c["both_right"]) == (6, 2, 1, 3, 1)
    assert c["delta"] == pytest.approx(sum(new) / 6 - sum(ref) / 6)
    assert (c["delta_low"], c["delta_high"]) == delta_interval(2, 1, 6)
    # the diagnostic: of the reference's 2 right answers (items 0 and 2), the new model kept item 0
    assert (c["reference_right"], c["kept"]) == (2, 0.5)
    assert compare([True], [False])["kept"] is None
    with pytest.raises(ValueError, match="same items"):
        compare(new, ref[:-1])
