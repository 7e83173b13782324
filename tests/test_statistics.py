"""The result tables' statistics against references: the t distribution's closed forms and table,
Holm by hand, and the exact tests against brute-force enumeration in float64."""

from __future__ import annotations

import itertools
import math

import pytest

from brace_lightning.statistics import (
    binomial_two_sided,
    fisher_exact,
    holm,
    holm_levels,
    mcnemar_exact,
    paired_t_test,
    student_t_cdf,
    student_t_quantile,
    verdict,
)

# t_{0.975, df} for df = 1..10 (printed tables, 3 decimals).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def test_student_t_matches_closed_forms_and_the_printed_table() -> None:
    for t in (-3.0, -0.5, 0.0, 0.7, 10.0):
        # df = 1 is the Cauchy distribution; df = 2 has F(t) = 1/2 + t / (2 sqrt(2 + t²)).
        assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    for df, value in enumerate(T975, start=1):
        assert student_t_quantile(0.975, df) == pytest.approx(value, abs=6e-4)
    assert student_t_quantile(0.995, 3) == pytest.approx(5.8409, abs=1e-4)
    assert student_t_quantile(0.025, 4) == pytest.approx(-2.7764, abs=1e-4)
    assert student_t_quantile(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)  # the normal's
    with pytest.raises(ValueError, match="probability must be in \\(0, 1\\); got 1.0"):
        student_t_quantile(1.0, 3)


def test_paired_t_test_interval_and_p_value_agree() -> None:
    diffs = [1.0, 2.0, 3.0]  # mean 2, se 1/sqrt(3)
    mean, low, high, p = paired_t_test(diffs)
    assert mean == 2.0
    assert high - mean == pytest.approx(4.30265 / math.sqrt(3), abs=1e-4)
    assert p == pytest.approx(2 * (1 - student_t_cdf(2 * math.sqrt(3), 2)), abs=1e-12)
    # The interval at level 1 - p has 0 on its edge.
    assert paired_t_test(diffs, alpha=p)[1] == pytest.approx(0.0, abs=1e-9)
    assert paired_t_test([0.5, 0.5]) == (0.5, 0.5, 0.5, 0.0)
    with pytest.raises(ValueError, match="at least 2 values; got 1"):
        paired_t_test([1.0])


def test_holm_adjusts_step_down_by_hand() -> None:
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted: 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 -> running max 0.06.
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm_levels(p) == pytest.approx([0.05 / 3, 0.05 / 1, 0.05 / 2, 0.05 / 4])
    assert holm([0.9, 0.3]) == [0.9, 0.6]  # 0.3·2, then max(0.6, 0.9·1)
    assert holm([]) == []


def _binomial_reference(k: int, n: int) -> float:
    probs = [math.comb(n, j) / 2**n for j in range(n + 1)]
    return min(1.0, sum(q for q in probs if q <= probs[k] + 1e-12))


def test_binomial_and_mcnemar_match_enumeration() -> None:
    for n in range(0, 13):
        for k in range(n + 1):
            assert binomial_two_sided(k, n) == pytest.approx(_binomial_reference(k, n), abs=1e-12)
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # 5 discordant pairs, all one way
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(2, 2) == 1.0


def _fisher_reference(a: int, b: int, c: int, d: int) -> float:
    """Every table with the same margins, enumerated cell by cell, in float64."""
    n = a + b + c + d

    def prob(x: int, y: int, z: int, w: int) -> float:
        return (
            math.factorial(x + y) * math.factorial(z + w) * math.factorial(x + z)
            * math.factorial(y + w) / (math.factorial(n) * math.factorial(x) * math.factorial(y)
                                       * math.factorial(z) * math.factorial(w))
        )  # fmt: skip

    observed = prob(a, b, c, d)
    total = 0.0
    for x, y, z, w in itertools.product(range(n + 1), repeat=4):
        same = (x + y, z + w, x + z) == (a + b, c + d, a + c) and x + y + z + w == n
        if same and prob(x, y, z, w) <= observed * (1 + 1e-9):
            total += prob(x, y, z, w)
    return min(1.0, total)


@pytest.mark.parametrize(
    "table", [(3, 1, 1, 3), (0, 4, 4, 0), (1, 3, 4, 0), (2, 2, 2, 2), (0, 5, 3, 1), (4, 0, 0, 0)]
)
def test_fisher_exact_matches_enumeration(table: tuple[int, int, int, int]) -> None:
    assert fisher_exact(*table) == pytest.approx(_fisher_reference(*table), abs=1e-12)


def test_fisher_tea_tasting_and_bad_counts() -> None:
    assert fisher_exact(3, 1, 1, 3) == pytest.approx(34 / 70)  # Fisher's lady tasting tea
    with pytest.raises(ValueError, match="counts must be >= 0"):
        fisher_exact(-1, 1, 1, 1)


def test_tie_only_inside_the_margin_otherwise_inconclusive() -> None:
    kwargs = {"higher_is_better": True, "mean": 0.001}
    assert verdict(-0.01, 0.012, significant=False, margin=0.02, **kwargs) == "tie (±0.02)"
    assert (
        verdict(-0.05, 0.052, significant=False, margin=0.02, **kwargs) == "inconclusive (±0.051)"
    )
    assert (
        verdict(-0.01, 0.012, significant=False, margin=None, **kwargs) == "inconclusive (±0.011)"
    )
    assert verdict(0.01, 0.02, significant=True, margin=0.02, **kwargs) == "better"
    assert (
        verdict(0.01, 0.02, significant=True, margin=None, higher_is_better=False, mean=0.015)
        == "worse"
    )
    assert (
        verdict(0.01, 0.02, significant=True, margin=None, higher_is_better=None, mean=0.015)
        == "higher"
    )
