"""Policies for :class:`~brace_lightning.sim.mdp.CountingMDP` and stale behavior policies µ.

Two ways to make µ differ from π, as in asynchronous RL:

- **Staleness along a learning sequence** (:func:`stale_pair`): a fixed sequence of natural
  policy-gradient steps θ_{n+1} = θ_n + η A^{π_n} + σ ξ_n on the logit table (tabular softmax NPG,
  Kakade 2001, plus fixed Gaussian noise ξ_n standing for the reward-irrelevant drift of an LM's
  token distribution between updates). With version n, π = π_n and µ = π_{n−S}: µ is S updates
  older and, because the steps improve reward, worse than π.
- **A perturbation with a given per-token KL** (:func:`perturb`): µ = softmax(θ + s ξ) with the
  scale s solved so that the per-token KL(µ ‖ π) equals a requested value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from brace_lightning.sim.mdp import (
    CountingMDP,
    action_values,
    exact_values,
    occupancy_from_good_probability,
)

__all__ = [
    "StalePair",
    "natural_gradient_step",
    "per_token_kl",
    "per_token_kl_of_log_probs",
    "perturb",
    "stale_pair",
    "uniform_logits",
]


def uniform_logits(mdp: CountingMDP) -> torch.Tensor:
    """``[T, C, A]`` float64 zeros: the uniform policy, P(good token) = 1/A everywhere."""
    return torch.zeros(mdp.logits_shape, dtype=torch.float64)


def natural_gradient_step(
    mdp: CountingMDP,
    logits: torch.Tensor,
    *,
    step_size: float,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One exact natural policy-gradient step on a tabular softmax policy, plus optional noise.

    θ' = θ + η (Q^π(t, c, a) − V^π(t, c)) + σ ξ,  ξ ~ N(0, 1) per entry (drawn from ``generator``).

    Args:
        mdp: the MDP.
        logits: ``[T, C, A]`` logits of π.
        step_size: η ≥ 0.
        noise: σ ≥ 0; 0 draws nothing from ``generator``.
        generator: torch random generator for ξ.

    Returns:
        ``[T, C, A]`` float64 logits of the next policy.
    """
    if not step_size >= 0.0:
        raise ValueError(f"step_size must be >= 0; got {step_size!r}.")
    if not noise >= 0.0:
        raise ValueError(f"noise must be >= 0; got {noise!r}.")
    values = exact_values(mdp, logits)
    advantages = action_values(mdp, values) - values[:-1, :, None]
    out = logits.to(torch.float64) + step_size * advantages
    if noise > 0.0:
        out = out + noise * torch.randn(mdp.logits_shape, generator=generator, dtype=torch.float64)
    return out


class StalePair(NamedTuple):
    """Behavior and target policies ``[T, C, A]``: µ = version n − S, π = version n."""

    behavior_logits: torch.Tensor
    target_logits: torch.Tensor


def stale_pair(
    mdp: CountingMDP,
    *,
    version: int,
    staleness: int,
    step_size: float,
    noise: float = 0.0,
    seed: int = 0,
    init_logits: torch.Tensor | None = None,
) -> StalePair:
    """Policies at versions n − S and n of a fixed learning sequence of NPG steps.

    The sequence starts at ``init_logits`` (uniform by default) and applies
    :func:`natural_gradient_step` ``version`` times with noise drawn from one generator seeded with
    ``seed``, so the same (seed, step_size, noise) always gives the same sequence and every
    staleness reads two points of it.

    Args:
        mdp: the MDP.
        version: n ≥ 0, the trainer's version (π).
        staleness: S in [0, n]; µ is version n − S.
        step_size: η of each step.
        noise: σ of each step's Gaussian drift.
        seed: seed of the drift.
        init_logits: ``[T, C, A]`` version 0; uniform if None.

    Returns:
        :class:`StalePair` (µ, π); with S = 0 both are the same tensor.
    """
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an int >= 0; got {version!r}.")
    if not isinstance(staleness, int) or not 0 <= staleness <= version:
        raise ValueError(f"staleness must be an int in [0, version={version}]; got {staleness!r}.")
    logits = uniform_logits(mdp) if init_logits is None else init_logits.to(torch.float64)
    mdp.check_logits("init_logits", logits)
    generator = torch.Generator().manual_seed(seed)
    behavior = logits
    for step in range(version):
        if step == version - staleness:
            behavior = logits
        logits = natural_gradient_step(
            mdp, logits, step_size=step_size, noise=noise, generator=generator
        )
    return StalePair(logits if staleness == 0 else behavior, logits)


def per_token_kl(
    mdp: CountingMDP, behavior_logits: torch.Tensor, target_logits: torch.Tensor
) -> torch.Tensor:
    """Per-token KL(µ ‖ π) on µ's own states: (1/T) Σ_t Σ_c d_µ(t, c) KL(µ(·|t, c) ‖ π(·|t, c)).

    This is −E_µ[log w] per action, the drift rate of log Π w along a sampled response.

    Args:
        mdp: the MDP.
        behavior_logits, target_logits: ``[T, C, A]`` logits of µ and π.

    Returns:
        0-dim float64 tensor.
    """
    mdp.check_logits("target_logits", target_logits)
    behavior_log_probs = torch.log_softmax(behavior_logits.to(torch.float64), dim=-1)
    return per_token_kl_of_log_probs(
        behavior_log_probs,
        torch.log_softmax(target_logits.to(torch.float64), dim=-1),
        occupancy_from_good_probability(mdp, behavior_log_probs[..., 0].exp()),
    )


def per_token_kl_of_log_probs(
    behavior_log_probs: torch.Tensor,
    target_log_probs: torch.Tensor,
    behavior_occupancy: torch.Tensor,
) -> torch.Tensor:
    """:func:`per_token_kl` from ``[T, C, A]`` float64 log-probabilities of µ and π and µ's
    ``[T, C]`` occupancy (no checks), for loops that already hold all three."""
    kl = (behavior_log_probs.exp() * (behavior_log_probs - target_log_probs)).sum(dim=-1)
    return (behavior_occupancy * kl).sum() / behavior_occupancy.shape[0]


def perturb(
    mdp: CountingMDP,
    logits: torch.Tensor,
    *,
    kl: float,
    seed: int = 0,
    rtol: float = 1e-3,
) -> torch.Tensor:
    """A behavior policy µ = softmax(θ + s ξ) whose per-token KL(µ ‖ π) equals ``kl``.

    ξ ~ N(0, 1) per entry of the table (seeded); the scale s is found by bisection on
    :func:`per_token_kl` (monotone in s for a fixed ξ in practice).

    Args:
        mdp: the MDP.
        logits: ``[T, C, A]`` logits of π.
        kl: the requested per-token KL, ≥ 0 (0 returns π itself).
        seed: seed of ξ.
        rtol: relative tolerance on the achieved KL.

    Returns:
        ``[T, C, A]`` float64 logits of µ.
    """
    mdp.check_logits("logits", logits)
    if not kl >= 0.0:
        raise ValueError(f"kl must be >= 0; got {kl!r}.")
    target = logits.to(torch.float64)
    if kl == 0.0:
        return target.clone()
    direction = torch.randn(
        mdp.logits_shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )

    def achieved(scale: float) -> float:
        return float(per_token_kl(mdp, target + scale * direction, target))

    low, high = 0.0, 1.0
    while achieved(high) < kl:
        low, high = high, 2.0 * high
        if high > 1e6:
            raise ValueError(f"kl={kl!r} is not reachable by perturbing the logits; use less.")
    for _ in range(100):
        middle = 0.5 * (low + high)
        value = achieved(middle)
        if abs(value - kl) <= rtol * kl:
            return target + middle * direction
        low, high = (middle, high) if value < kl else (low, middle)
    return target + 0.5 * (low + high) * direction
