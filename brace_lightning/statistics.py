"""The statistics the result tables use, in plain Python (no scipy): Student-t intervals and tests
at any level, Holm's step-down adjustment, and exact tests for survive/collapse counts.

- Student t: the CDF through the regularized incomplete beta function, F(t; ν) = 1 − ½ I_x(ν/2, ½)
  with x = ν / (ν + t²) for t ≥ 0 (continued fraction, Numerical Recipes §6.4, to 1e-14), and the
  quantile by bisection on it. Used for paired differences over seeds (3-4 in the sims).
- Holm (1979): with m p-values sorted p_(1) ≤ … ≤ p_(m), the adjusted p_(i) is
  max_{j ≤ i} min(1, (m − j + 1) p_(j)); it controls the family-wise error at α without
  assuming independence. The interval reported with a comparison is the paired t-interval at
  its Holm step's level 1 − α / (m − i + 1) (the Bonferroni interval for the smallest p).
- Exact tests for 0/1 outcomes such as "the run survived": McNemar's exact test for outcomes
  paired by seed (a two-sided binomial test with p = ½ on the discordant pairs) and Fisher's
  exact test for two unpaired groups (two-sided: every table with the same margins whose
  probability is at most the observed one's). Sums of probabilities, computed exactly with
  integer binomial coefficients.
- Equivalence: a difference is called a tie only when its interval lies inside a stated margin
  (±margin, an interval-inside-margin test, at least as strict as TOST at the same level);
  otherwise, when the interval covers 0, it is inconclusive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "binomial_two_sided",
    "fisher_exact",
    "holm",
    "holm_levels",
    "mcnemar_exact",
    "paired_t_test",
    "student_t_cdf",
    "student_t_quantile",
    "verdict",
]


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 ≤ x ≤ 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` > 0 degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be > 0; got {df!r}.")
    tail = 0.5 * _regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(probability: float, df: float) -> float:
    """The t with P(T ≤ t) = ``probability`` (0 < probability < 1), by bisection to 1e-12."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must be in (0, 1); got {probability!r}.")
    if probability < 0.5:
        return -student_t_quantile(1.0 - probability, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < probability:
        low, high = high, 2.0 * high
    while high - low > 1e-12 * max(1.0, high):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if student_t_cdf(middle, df) < probability else (low, middle)
    return 0.5 * (low + high)


def paired_t_test(
    differences: Sequence[float], *, alpha: float = 0.05
) -> tuple[float, float, float, float]:
    """Mean, two-sided ``1 − alpha`` Student-t interval and two-sided p-value of H0: mean = 0.

    Returns:
        ``(mean, low, high, p)``. With no spread (all differences equal) the interval is the
        point and p is 0 (or 1 when the mean is 0).

    Raises:
        ValueError: with fewer than 2 differences.
    """
    n = len(differences)
    if n < 2:
        raise ValueError(f"differences must hold at least 2 values; got {n}.")
    mean = sum(differences) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in differences) / (n - 1) / n)
    if se == 0.0:
        return mean, mean, mean, 1.0 if mean == 0.0 else 0.0
    half = student_t_quantile(1.0 - alpha / 2.0, n - 1) * se
    p = 2.0 * (1.0 - student_t_cdf(abs(mean) / se, n - 1))
    return mean, mean - half, mean + half, min(1.0, p)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's adjusted p-values, in the order given (module docstring)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def holm_levels(p_values: Sequence[float], alpha: float = 0.05) -> list[float]:
    """The per-comparison level α / (m − i + 1) of each p-value's Holm step, in the order given."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    levels = [0.0] * m
    for rank, i in enumerate(order):
        levels[i] = alpha / (m - rank)
    return levels


def binomial_two_sided(successes: int, trials: int, p: float = 0.5) -> float:
    """Exact two-sided binomial p-value: the total probability of the outcomes no more likely
    than ``successes`` out of ``trials`` (relative tolerance 1e-7 for ties in probability)."""
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must be in [0, trials = {trials}]; got {successes!r}.")
    probabilities = [
        math.comb(trials, k) * p**k * (1.0 - p) ** (trials - k) for k in range(trials + 1)
    ]
    observed = probabilities[successes]
    return min(1.0, sum(q for q in probabilities if q <= observed * (1.0 + 1e-7)))


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Exact McNemar p-value for paired 0/1 outcomes: ``only_first`` pairs where only the first
    arm has the outcome (e.g. survived), ``only_second`` where only the second; 1 with no
    discordant pair."""
    trials = only_first + only_second
    return 1.0 if trials == 0 else binomial_two_sided(only_first, trials)


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided Fisher exact p-value of the 2×2 table [[a, b], [c, d]] (rows: groups, columns:
    outcome yes/no): the hypergeometric probability of every table with the same margins that
    is no more likely than the observed one."""
    if min(a, b, c, d) < 0:
        raise ValueError(f"the table's counts must be >= 0; got {[a, b, c, d]!r}.")
    row, column, total = a + b, a + c, a + b + c + d

    def probability(x: int) -> float:
        return math.comb(row, x) * math.comb(total - row, column - x) / math.comb(total, column)

    observed = probability(a)
    support = range(max(0, column - (total - row)), min(row, column) + 1)
    return min(1.0, sum(q for q in map(probability, support) if q <= observed * (1.0 + 1e-7)))


def verdict(
    low: float,
    high: float,
    *,
    significant: bool,
    higher_is_better: bool | None,
    margin: float | None,
    mean: float,
) -> str:
    """The word for a difference with interval [low, high]: ``better``/``worse`` (or
    ``higher``/``lower`` with no better side) when ``significant``; ``tie (±margin)`` when the
    interval lies inside ±``margin``; else ``inconclusive (±h)`` with h the interval's half-width."""
    if significant:
        if higher_is_better is None:
            return "higher" if mean > 0 else "lower"
        return "better" if (mean > 0) == higher_is_better else "worse"
    if margin is not None and -margin <= low and high <= margin:
        return f"tie (±{margin:g})"
    return f"inconclusive (±{(high - low) / 2:.3g})"
