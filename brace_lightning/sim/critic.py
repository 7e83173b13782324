"""Tabular critic fitted the way the trainer fits its critic: regress onto a value target, repeat.

Each iteration recomputes the estimator's targets v_s on a fixed batch of µ-data with the current
critic, then moves every visited state's value towards the mean target there:

    V(t, c) ← V(t, c) + α (mean{v_s : s visits (t, c)} − V(t, c)),

α = 1 being the exact least-squares fit of a tabular critic. The iteration's fixed point is the
estimator's empirical fixed point on that batch (Proposition 1: V^µ for GAE with λ = 1; V-trace's
is V of the ρ̄-truncated policy; BRACE's, Proposition 2, lies between), which is what a critic
trained to convergence on stale data learns.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from brace_lightning.sim.mdp import CountingMDP, Trajectories, state_values

__all__ = ["CriticFit", "ValueTargetFn", "fit_critic"]


class _HasReturns(Protocol):
    @property
    def returns(self) -> torch.Tensor: ...


class ValueTargetFn(Protocol):
    """Anything called like :class:`brace_lightning.targets.ValueTarget` (all inputs ``[B, T]``)."""

    def __call__(
        self,
        *,
        rewards: torch.Tensor,
        values: torch.Tensor,
        target_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        mask: torch.Tensor,
    ) -> _HasReturns: ...


class CriticFit(NamedTuple):
    """Result of :func:`fit_critic`.

    Attributes:
        values: ``[T + 1, C]`` float64 fitted table; unvisited states keep their initial value and
            row T is 0 (terminal).
        visits: ``[T, C]`` long, number of sampled actions taken at each state.
        iterations: iterations run.
        converged: whether the last change was below ``tol``.
        max_change: sup over visited states of the last iteration's change.
    """

    values: torch.Tensor
    visits: torch.Tensor
    iterations: int
    converged: bool
    max_change: float


def fit_critic(
    mdp: CountingMDP,
    trajectories: Trajectories,
    target: ValueTargetFn,
    *,
    init: torch.Tensor | None = None,
    lr: float = 1.0,
    max_iterations: int = 200,
    tol: float = 1e-3,
) -> CriticFit:
    """Fit a tabular critic ``[T + 1, C]`` to a value target on fixed µ-data until it stops moving.

    Args:
        mdp: the MDP the trajectories come from.
        trajectories: ``[B, T]`` µ-data from :func:`~brace_lightning.sim.mdp.sample`.
        target: a value-target estimator, e.g. ``brace_lightning.targets.BRACE(k=100)``.
        init: ``[T + 1, C]`` initial table (zeros if None), e.g. ``exact_values(mdp, µ)`` for a
            critic that had already converged on the stale policy.
        lr: α in (0, 1], the step towards each state's mean target (1 = exact least squares).
        max_iterations: most iterations, ≥ 1.
        tol: stop when the sup-norm change over visited states is below this, ≥ 0.

    Returns:
        :class:`CriticFit`.
    """
    if not 0.0 < lr <= 1.0:
        raise ValueError(f"lr must be in (0, 1]; got {lr!r}.")
    if not isinstance(max_iterations, int) or max_iterations < 1:
        raise ValueError(f"max_iterations must be an int >= 1; got {max_iterations!r}.")
    if not tol >= 0.0:
        raise ValueError(f"tol must be >= 0; got {tol!r}.")
    horizon, counts = mdp.horizon, mdp.num_counts
    if tuple(trajectories.counts.shape[1:]) != (horizon,):
        raise ValueError(
            f"trajectories have {trajectories.counts.shape[1]} columns; expected T = {horizon}."
        )
    shape = (horizon + 1, counts)
    table = torch.zeros(shape, dtype=torch.float64) if init is None else init.to(torch.float64)
    if tuple(table.shape) != shape:
        raise ValueError(f"init has shape {tuple(table.shape)}; expected (T + 1, C) = {shape}.")
    table = table.clone()
    table[horizon] = 0.0

    # Flat state index of every sampled action; only action columns enter the regression.
    mask = trajectories.mask
    flat = (torch.arange(horizon) * counts + trajectories.counts)[mask]
    visits = torch.bincount(flat, minlength=horizon * counts)
    visited = visits > 0
    current = table[:horizon].reshape(-1)  # a view: updating it updates the table

    change = float("inf")
    iterations = 0
    while iterations < max_iterations and change >= tol:
        iterations += 1
        values = state_values(table, trajectories.counts)
        returns = target(
            rewards=trajectories.rewards,
            values=values,
            target_logprobs=trajectories.target_logprobs,
            behavior_logprobs=trajectories.behavior_logprobs,
            mask=mask,
        ).returns
        sums = torch.bincount(
            flat, weights=returns[mask].to(torch.float64), minlength=visits.numel()
        )
        step = lr * (sums[visited] / visits[visited] - current[visited])
        current[visited] += step
        change = float(step.abs().max()) if step.numel() else 0.0
    return CriticFit(
        values=table,
        visits=visits.reshape(horizon, counts),
        iterations=iterations,
        converged=change < tol,
        max_change=change,
    )
