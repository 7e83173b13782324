"""Actor step sizes that adapt to how off-policy the batch is (issue 30).

Two rules, each an :class:`ActorStepSize` (``model.actor_step_size``), both scaling the actor's
learning rate by a factor in (0, 1] per rollout step:

- :class:`ESSAdaptiveStepSize`, from the batch's importance weights (VCPO, below);
- :class:`StalenessAdaptiveStepSize`, from the batch's mean staleness S̄ (in policy versions):
  the step runs at lr × min(1, B / (S̄ · lr)), so that S̄ × (the lr actually used) never exceeds
  the budget B. The staleness–learning-rate scaling result is that stale-gradient collapse is
  governed by the product S · η; this rule keeps that product under a budget from the first stale
  step on, where the ESS factor only reacts once the actor has already moved away from µ.
  Optionally times an ESS rule's factor (``ess``).

VCPO (Huang et al. 2026, "Stable Asynchrony") scales the actor's learning rate by the effective
sample size of the batch's importance weights: a batch far from the current policy (small ESS/N)
takes a smaller step. Here, per rollout step,

    scale = clamp((ESS/N)^power, min_scale, 1),   ESS/N = (Σ w)² / (N Σ w²),  w = π_prox/µ,

over the action tokens of all data-parallel ranks (every rank takes the same step), and every actor
optimizer step of the rollout step runs at ``lr × scale``. The learning rate, not the loss, is
scaled: AdamW divides the gradient by its running RMS, so a scaled loss would leave the update
(almost) unchanged. :func:`brace_lightning.optim.clipped_step` sets each parameter group's lr for
the step and restores it, so schedulers and checkpoints never see the scaled value.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch

from brace_lightning import optim
from brace_lightning.hparams import from_config
from brace_lightning.objectives.functional import MAX_LOG_RATIO
from brace_lightning.ranks import Ranks
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.scorer import Scored


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def global_ess_fraction(log_weights: torch.Tensor, mask: torch.Tensor, ranks: Ranks) -> float:
    """ESS/N = (Σw)² / (N Σw²) of the weights exp(``log_weights``) ``[B, T]`` at ``mask`` over all
    ranks, in float64 with every log-weight shifted by the global maximum (no overflow). 1 for no
    action at all (nothing to discount)."""
    log_w = torch.where(mask, log_weights.detach().double(), -math.inf)
    top = log_w.max() if log_w.numel() else torch.tensor(-math.inf, dtype=torch.float64)
    if ranks.world_size > 1:
        top = ranks.strategy.reduce(top, reduce_op="max")
    if not bool(torch.isfinite(top)):
        return 1.0
    shifted = torch.exp(log_w - top)  # 0 at non-actions
    sums = torch.stack([shifted.sum(), shifted.square().sum(), mask.sum().double()])
    if ranks.world_size > 1:
        sums = ranks.strategy.reduce(sums, reduce_op="sum")
    first, second, count = sums.tolist()
    return first * first / (count * second)


class ActorStepSize:
    """A rule for the actor's step size: per rollout step, named factors in (0, 1] whose product
    multiplies the actor's learning rate (:func:`actor_lr_scale`)."""

    def factors(
        self,
        batch: RolloutBatch,
        proximal: torch.Tensor,
        ranks: Ranks,
        *,
        policy_version: int,
        lr: float,
    ) -> dict[str, float]:
        """The factors for ``batch`` (log π_prox ``proximal`` ``[B, T]``) with the trainer at
        ``policy_version`` and the actor's current (unscaled) ``lr``, by name."""
        raise NotImplementedError


class ESSAdaptiveStepSize(ActorStepSize):
    """The actor's learning rate times clamp((ESS/N)^power, min_scale, 1) on every rollout step.

    ESS/N is that of the behaviour weights w = π_prox/µ of the batch's action tokens (log w clamped
    to ±20 like every ratio), over all ranks. Off-policy batches take smaller steps; an on-policy
    batch (w = 1) takes the full one. Logged as ``lr/actor_scale``.

    Args:
        power: p > 0 in (ESS/N)^p; 1 is the ESS fraction itself, 0.5 a milder rule.
        min_scale: the smallest factor, in (0, 1]: a collapsed ESS never stops the actor.
    """

    def __init__(self, *, power: float = 1.0, min_scale: float = 0.1) -> None:
        if not (_number(power) and 0.0 < power < math.inf):
            raise ValueError(f"power must be a positive finite number; got {power!r}.")
        if not (_number(min_scale) and 0.0 < min_scale <= 1.0):
            raise ValueError(f"min_scale must be in (0, 1]; got {min_scale!r}.")
        self.power = power
        self.min_scale = min_scale

    def __call__(
        self,
        proximal_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        mask: torch.Tensor,
        ranks: Ranks,
    ) -> float:
        """The step-size factor of a batch: log π_prox, log µ ``[B, T]``, ``mask`` True at actions."""
        log_w = (proximal_logprobs - behavior_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        ess = global_ess_fraction(log_w, mask, ranks)
        return min(1.0, max(self.min_scale, ess**self.power))

    def factors(
        self,
        batch: RolloutBatch,
        proximal: torch.Tensor,
        ranks: Ranks,
        *,
        policy_version: int,
        lr: float,
    ) -> dict[str, float]:
        return {"ess": self(proximal, batch.behavior_logprobs, batch.mask, ranks)}

    def __repr__(self) -> str:
        return f"ESSAdaptiveStepSize(power={self.power!r}, min_scale={self.min_scale!r})"


class StalenessAdaptiveStepSize(ActorStepSize):
    """The actor's learning rate capped so that S̄ × lr stays within a budget: every actor optimizer
    step of a rollout step runs at lr × min(1, ``lr_budget`` / (S̄ · lr)), S̄ the mean staleness
    (trainer version − the version that sampled the token) over the batch's action tokens on all
    ranks, lr the actor's current lr. Fresh batches (S̄ · lr ≤ budget) take the full step,
    bit for bit; a batch S versions old takes at most ``lr_budget / S``. Logged as
    ``lr/actor_scale_staleness`` (and the product of all factors as ``lr/actor_scale``).

    Args:
        lr_budget: B > 0, the largest S̄ · lr a step may take (versions × learning rate).
        ess: an :class:`ESSAdaptiveStepSize` whose factor multiplies this one (logged as
            ``lr/actor_scale_ess``), or None.
    """

    def __init__(
        self, *, lr_budget: float, ess: ESSAdaptiveStepSize | dict[str, Any] | None = None
    ) -> None:
        if not (_number(lr_budget) and 0.0 < lr_budget < math.inf):
            raise ValueError(f"lr_budget must be a positive finite number; got {lr_budget!r}.")
        if ess is not None:
            ess = from_config(ess, ESSAdaptiveStepSize, "ess")
        self.lr_budget = lr_budget
        self.ess = ess

    def scale(self, staleness: float, lr: float) -> float:
        """min(1, budget / (``staleness`` · ``lr``)); exactly 1 where the product is within it."""
        product = staleness * lr
        return 1.0 if product <= self.lr_budget else self.lr_budget / product

    def factors(
        self,
        batch: RolloutBatch,
        proximal: torch.Tensor,
        ranks: Ranks,
        *,
        policy_version: int,
        lr: float,
    ) -> dict[str, float]:
        staleness = global_mean_staleness(batch, policy_version, ranks)
        out = {"staleness": self.scale(staleness, lr)}
        if self.ess is not None:
            out |= self.ess.factors(batch, proximal, ranks, policy_version=policy_version, lr=lr)
        return out

    def __repr__(self) -> str:
        return f"StalenessAdaptiveStepSize(lr_budget={self.lr_budget!r}, ess={self.ess!r})"


def global_mean_staleness(batch: RolloutBatch, policy_version: int, ranks: Ranks) -> float:
    """The mean of ``policy_version`` − (the version that sampled the token) over the action
    tokens of all ranks, in float64; 0 for no action at all."""
    ages = torch.where(batch.mask, policy_version - batch.versions, 0).double()
    sums = torch.stack([ages.sum(), batch.mask.sum().double()])
    if ranks.world_size > 1:
        sums = ranks.strategy.reduce(sums, reduce_op="sum")
    total, count = sums.tolist()
    return total / count if count > 0 else 0.0


def scale_and_log(
    rule: ActorStepSize,
    batch: RolloutBatch,
    scored: Scored,
    ranks: Ranks,
    metrics: dict[str, float],
    *,
    policy_version: int,
    lr: float,
) -> float:
    """The product of ``rule``'s factors for ``batch`` (π_prox from ``scored``; the trainer at
    ``policy_version``; the actor's unscaled ``lr``), put in ``metrics`` as ``lr/actor_scale``, and
    each factor of a rule other than the ESS rule alone as ``lr/actor_scale_<name>``."""
    factors = rule.factors(batch, scored.proximal, ranks, policy_version=policy_version, lr=lr)
    scale = math.prod(factors.values())
    metrics["lr/actor_scale"] = scale
    if not isinstance(rule, ESSAdaptiveStepSize):
        metrics |= {f"lr/actor_scale_{name}": value for name, value in factors.items()}
    return scale


def actor_lr_scale(
    module: pl.LightningModule, batch: RolloutBatch, scored: Scored, metrics: dict[str, float]
) -> float | None:
    """:func:`scale_and_log` of ``module.actor_step_size`` at the module's policy version and its
    actor's current lr; None without a rule (the optimizer's lr is then left alone)."""
    rule = module.actor_step_size
    if rule is None:
        return None
    return scale_and_log(
        rule,
        batch,
        scored,
        module.ranks,
        metrics,
        policy_version=module.policy_version,
        lr=optim.actor_lr(module),
    )
