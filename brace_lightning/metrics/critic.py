"""Critic-bias diagnostics of the BRACE paper as torchmetrics: ĝ_π, b̂ by position, β by horizon,
and the critic's proper score against realized returns.

Which score for a critic: against a noisy reference such as a 0/1 Monte-Carlo return G, the mean
absolute error E|V − G| is minimised by the conditional *median* of G (0 or 1), not by V^π = E[G]:
for G ~ Bernoulli(p), E|V − G| = p + V(1 − 2p), linear in V. The squared error E(V − G)² (the Brier
score for 0/1 rewards) is a proper score: it equals Var(G) + (V − V^π)², minimised exactly at V^π,
so differences between critics in it are differences in (V − V^π)². :func:`critic_scores` bundles
the proper score, the signed bias mean(V − G) by position bin (an estimate of the paper's ĝ_π and
b(s_t) with its sign) and the absolute error under a name that says what it is.

Every state is a sum (``dist_reduce_fx="sum"``), so the metrics reduce across processes and merge
with :meth:`torchmetrics.Metric.merge_state` exactly. Sums are kept in float64.

Binned metrics take ``bin_edges``, the inclusive left edges e_0 < e_1 < … of their bins in action
steps: bin i holds e_i ≤ x < e_{i+1}, the last bin is open-ended, and x < e_0 is not counted. Their
``compute()`` returns :class:`Binned` with no NaN: a bin whose statistic is undefined (no data, or
for β no spread in the return) has ``value`` 0 and ``defined`` False.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torchmetrics import Metric, MetricCollection

from brace_lightning.metrics.base import KeptDtypeMetric
from brace_lightning.metrics.functional import (
    action_index,
    bin_index,
    check_bin_edges,
    check_mask,
    remaining_horizon,
)

__all__ = [
    "CRITIC_SCORE_EDGES",
    "Binned",
    "HorizonBeta",
    "SeparationByPosition",
    "SignedValueBias",
    "ValueBiasGap",
    "ValueSquaredError",
    "critic_scores",
    "power_of_two_edges",
]

#: Left edges (action index) of :func:`critic_scores`' position bins: 0-7, 8-31, 32-127, 128 on.
CRITIC_SCORE_EDGES = (0, 8, 32, 128)


def power_of_two_edges(largest: int, *, start: int = 0) -> tuple[int, ...]:
    """Bin edges: ``start`` followed by the powers of two above it, up to ``largest``.

    E.g. ``power_of_two_edges(8) == (0, 1, 2, 4, 8)``; ``power_of_two_edges(8, start=1) ==
    (1, 2, 4, 8)``.
    """
    if not isinstance(largest, int) or largest < 1:
        raise ValueError(f"largest must be an int >= 1; got {largest!r}.")
    edges = [start]
    power = 1
    while power <= largest:
        if power > start:
            edges.append(power)
        power *= 2
    return tuple(edges)


class Binned(NamedTuple):
    """Per-bin result of a binned metric, each ``[num_bins]``.

    Attributes:
        value: the statistic in each bin, 0 where undefined.
        count: number of actions that fell in each bin (long).
        defined: bool, whether ``value`` is defined.
        edges: left edges of the bins in action steps (long).
    """

    value: torch.Tensor
    count: torch.Tensor
    defined: torch.Tensor
    edges: torch.Tensor


class ValueBiasGap(KeptDtypeMetric):
    """ĝ_π: mean absolute gap between the critic and a reference value over actions (paper Fig. 4a).

        ĝ_π = (1 / N) Σ_{actions} |V(s_t) − V_ref(s_t)|

    V_ref is the exact V^π in :mod:`brace_lightning.sim`, or Monte-Carlo returns of fresh on-policy
    rollouts in real training. ``compute()`` is a 0-dim float64 tensor, NaN before any action.

    Update args:
        values: ``[B, T]`` the critic's values V(s_t) (the state before action t).
        reference: ``[B, T]`` the reference V_ref(s_t).
        mask: ``[B, T]`` bool, True at actions.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    abs_sum: torch.Tensor
    count: torch.Tensor

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.add_state("abs_sum", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> None:
        check_mask(mask, values=values, reference=reference)
        gap = (values.double() - reference.double()).abs()
        self.abs_sum += gap[mask].sum()
        self.count += mask.sum()

    def compute(self) -> torch.Tensor:
        return self.abs_sum / self.count


class ValueSquaredError(KeptDtypeMetric):
    """Mean squared error of the critic to a reference over actions: the proper critic score.

        MSE = (1 / N) Σ_{actions} (V(s_t) − G_t)²

    With G_t the realized return of on-policy rollouts (0/1 rewards: the Brier score), its
    expectation is Var(G_t) + (V(s_t) − V^π(s_t))², minimised by V = V^π (module docstring), so
    it ranks critics by their distance to V^π up to a term that is the same for every critic.
    ``compute()`` is a 0-dim float64 tensor, NaN before any action.

    Update args:
        values: ``[B, T]`` the critic's values V(s_t).
        reference: ``[B, T]`` the reference, e.g. realized returns G_t.
        mask: ``[B, T]`` bool, True at actions.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    square_sum: torch.Tensor
    count: torch.Tensor

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.add_state("square_sum", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> None:
        check_mask(mask, values=values, reference=reference)
        error = values.double() - reference.double()
        self.square_sum += (error[mask] ** 2).sum()
        self.count += mask.sum()

    def compute(self) -> torch.Tensor:
        return self.square_sum / self.count


class SignedValueBias(KeptDtypeMetric):
    """Signed mean gap mean(V(s_t) − G_t) over the actions whose action index n_t is in
    ``[start, stop)``: the estimate of the paper's ĝ_π with its sign, by position (b(s_t) when the
    critic has converged to V^µ and G is on-policy).

    A scalar per instance (one per bin in :func:`critic_scores`) so that Lightning logs each bin
    as its own metric. ``compute()`` is a 0-dim float64 tensor, NaN when no action fell in the bin.

    Args:
        start: first action index counted, ≥ 0.
        stop: first action index not counted (None: no end), > ``start``.

    Update args:
        values: ``[B, T]`` the critic's values V(s_t).
        reference: ``[B, T]`` the reference, e.g. realized returns G_t.
        mask: ``[B, T]`` bool, True at actions.
    """

    is_differentiable = False
    full_state_update = False

    diff_sum: torch.Tensor
    count: torch.Tensor

    def __init__(self, start: int = 0, stop: int | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be an int >= 0; got {start!r}.")
        if stop is not None and (not isinstance(stop, int) or stop <= start):
            raise ValueError(f"stop must be None or an int > start = {start}; got {stop!r}.")
        self.start, self.stop = start, stop
        self.add_state("diff_sum", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> None:
        check_mask(mask, values=values, reference=reference)
        index = action_index(mask)
        keep = mask & (index >= self.start)
        if self.stop is not None:
            keep &= index < self.stop
        self.diff_sum += (values.double() - reference.double())[keep].sum()
        self.count += keep.sum()

    def compute(self) -> torch.Tensor:
        return self.diff_sum / self.count


def critic_scores(
    bin_edges: Sequence[int] = CRITIC_SCORE_EDGES, *, prefix: str = ""
) -> MetricCollection:
    """The critic's scores against realized returns, as one collection updated with
    ``(values [B, T], returns [B, T], mask [B, T])`` and logged with ``log_dict``:

    - ``value_mse_mc``: mean (V − G)², the proper score (:class:`ValueSquaredError`), the headline;
    - ``value_bias_mc``: mean (V − G) over every action (:class:`SignedValueBias`);
    - ``value_bias_pos{a}_{b}``: mean (V − G) over action indices a ≤ n < b, one per bin of
      ``bin_edges`` (the last ``value_bias_pos{a}_up``);
    - ``value_abs_error_mc``: mean |V − G| (:class:`ValueBiasGap`), *not* a proper score against
      0/1 returns (module docstring): kept to compare with older logs.

    Args:
        bin_edges: increasing left edges of the position bins, the first ≥ 0.
        prefix: prepended to every name (``"val/"`` in the module).
    """
    edges = check_bin_edges("bin_edges", bin_edges).tolist()
    metrics: dict[str, Metric] = {
        "value_mse_mc": ValueSquaredError(),
        "value_bias_mc": SignedValueBias(),
        "value_abs_error_mc": ValueBiasGap(),
    }
    for start, stop in zip(edges, [*edges[1:], None], strict=True):
        name = f"value_bias_pos{start}_{'up' if stop is None else stop}"
        metrics[name] = SignedValueBias(start, stop)
    # compute_groups=False: bins that are equal after the first batch must not share their state.
    return MetricCollection(metrics, prefix=prefix, compute_groups=False)


class SeparationByPosition(KeptDtypeMetric):
    """b̂ by position: mean of b(s_t) = V^π(s_t) − V^µ(s_t) in bins of action index (paper Fig. 2a).

    The difference is given by the caller (exact in the simulator, or any estimate); positions are
    action indices n_t (0 at a row's first action, holes skipped).

    Args:
        bin_edges: left edges of the position bins in action steps (see module docstring);
            default 0, 1, 2, 4, …, 32768.

    Update args:
        diff: ``[B, T]`` b(s_t) at each action.
        mask: ``[B, T]`` bool, True at actions.

    ``compute()`` returns :class:`Binned` with the mean difference per bin.
    """

    is_differentiable = False
    full_state_update = False

    diff_sum: torch.Tensor
    count: torch.Tensor

    def __init__(
        self, bin_edges: Sequence[int] = power_of_two_edges(32768), **kwargs: object
    ) -> None:
        super().__init__(**kwargs)
        self.register_buffer("edges", check_bin_edges("bin_edges", bin_edges), persistent=False)
        num_bins = len(self.edges)
        self.add_state("diff_sum", torch.zeros(num_bins, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(num_bins, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, diff: torch.Tensor, mask: torch.Tensor) -> None:
        check_mask(mask, diff=diff)
        bins = bin_index(action_index(mask), self.edges)
        keep = mask & (bins >= 0)
        index = bins[keep]
        self.diff_sum.index_add_(0, index, diff[keep].double())
        self.count.index_add_(0, index, torch.ones_like(index))

    def compute(self) -> Binned:
        defined = self.count > 0
        value = torch.where(defined, self.diff_sum / self.count.clamp(min=1), 0.0)
        return Binned(value, self.count, defined, self.edges)


class HorizonBeta(KeptDtypeMetric):
    """β by remaining horizon: least-squares slope of a value target on the realized return (Fig. 2b).

    Within each bin of remaining horizon h_t (actions from t to the row's end, 1 at the last
    action), with x = realized return-to-go G_t and y = the estimator's target v_t:

        β = (n Σxy − Σx Σy) / (n Σx² − (Σx)²).

    β = 1 when the target is the return itself (GAE with λ = 1); a target whose coefficient on the
    terminal reward vanishes with h (V-trace under stale data) has β → 0 at long horizons. Needs no
    ground truth. A bin is undefined (value 0, ``defined`` False) when it holds no action or the
    return has no spread in it (n Σx² − (Σx)² ≤ 1e-12 · n Σx²).

    Args:
        bin_edges: left edges of the remaining-horizon bins in action steps (h ≥ 1);
            default 1, 2, 4, …, 32768.

    Update args:
        value_targets: ``[B, T]`` v_t from an estimator (``ValueTargets.returns``).
        realized_returns: ``[B, T]`` G_t, e.g. :func:`~brace_lightning.metrics.functional.reward_to_go`.
        mask: ``[B, T]`` bool, True at actions.

    ``compute()`` returns :class:`Binned` with β per bin.
    """

    is_differentiable = False
    full_state_update = False

    n: torch.Tensor
    sum_x: torch.Tensor
    sum_y: torch.Tensor
    sum_xy: torch.Tensor
    sum_xx: torch.Tensor

    def __init__(
        self, bin_edges: Sequence[int] = power_of_two_edges(32768, start=1), **kwargs: object
    ) -> None:
        super().__init__(**kwargs)
        self.register_buffer("edges", check_bin_edges("bin_edges", bin_edges), persistent=False)
        num_bins = len(self.edges)
        self.add_state("n", torch.zeros(num_bins, dtype=torch.long), dist_reduce_fx="sum")
        for name in ("sum_x", "sum_y", "sum_xy", "sum_xx"):
            self.add_state(name, torch.zeros(num_bins, dtype=torch.float64), dist_reduce_fx="sum")

    def update(
        self, value_targets: torch.Tensor, realized_returns: torch.Tensor, mask: torch.Tensor
    ) -> None:
        check_mask(mask, value_targets=value_targets, realized_returns=realized_returns)
        bins = bin_index(remaining_horizon(mask), self.edges)
        keep = mask & (bins >= 0)
        index = bins[keep]
        x, y = realized_returns[keep].double(), value_targets[keep].double()
        self.n.index_add_(0, index, torch.ones_like(index))
        self.sum_x.index_add_(0, index, x)
        self.sum_y.index_add_(0, index, y)
        self.sum_xy.index_add_(0, index, x * y)
        self.sum_xx.index_add_(0, index, x * x)

    def compute(self) -> Binned:
        n = self.n.double()
        denominator = n * self.sum_xx - self.sum_x**2
        defined = (self.n > 0) & (denominator > 1e-12 * n * self.sum_xx)
        slope = (n * self.sum_xy - self.sum_x * self.sum_y) / torch.where(defined, denominator, 1.0)
        return Binned(torch.where(defined, slope, 0.0), self.n, defined, self.edges)
