"""An actor step size that adapts to how off-policy the batch is (VCPO's rule, issue 30).

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

import torch

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


class ESSAdaptiveStepSize:
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

    def __repr__(self) -> str:
        return f"ESSAdaptiveStepSize(power={self.power!r}, min_scale={self.min_scale!r})"


def actor_lr_scale(
    rule: ESSAdaptiveStepSize | None,
    batch: RolloutBatch,
    scored: Scored,
    ranks: Ranks,
    metrics: dict[str, float],
) -> float | None:
    """``rule``'s factor for ``batch`` (π_prox from ``scored``), also put in ``metrics`` as
    ``lr/actor_scale``; None without a rule (the optimizer's lr is then left alone)."""
    if rule is None:
        return None
    scale = rule(scored.proximal, batch.behavior_logprobs, batch.mask, ranks)
    metrics["lr/actor_scale"] = scale
    return scale
