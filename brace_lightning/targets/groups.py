"""Critic-free, group-relative advantages: GRPO, Dr. GRPO and RLOO over prompt groups.

A prompt group is the ``samples_per_prompt`` responses sampled for one prompt (rows sharing
``group_ids``). Each response i of group g, with sequence reward r_i, gets one advantage

    GRPO     A_i = (r_i − mean_g) / (std_g + eps)     (Shao et al. 2024, DeepSeekMath §4.1.2)
    DrGRPO   A_i =  r_i − mean_g                      (Liu et al. 2025, "Understanding R1-Zero" §3)
    RLOO     A_i =  r_i − mean_{g∖i}                  (Ahmadian et al. 2024: leave-one-out mean)

with the conventions of TRL 1.16's ``GRPOTrainer`` (``scale_rewards="group"``): ``std_g`` is the
*unbiased* (Bessel, n − 1) standard deviation of the group's rewards and ``eps`` is added to it, not
under the root (TRL uses eps = 1e-4, the :class:`~brace_lightning.targets.GRPO` default). A group of
one row has advantage 0 under every estimator (no spread to learn from; its std is taken as 0).

**Importance-weighted (self-normalised) baseline** (the paper's open question 3). Under staleness
the group's responses were sampled by µ, so ``mean_g`` estimates E_µ[r], not E_π[r]. With weights
w_i (truncated sequence ratios min(ρ̄, π(y_i)/µ(y_i)), as BRACE truncates its ρ), the baseline is
the self-normalised importance-sampling estimate of E_π[r]:

    mean_g = Σ_j w_j r_j / Σ_j w_j        mean_{g∖i} = Σ_{j≠i} w_j r_j / Σ_{j≠i} w_j   (RLOO)

Only the baseline is weighted: GRPO's scale ``std_g`` stays the unweighted group std, and RLOO's
leave-one-out baseline does not depend on w_i, so A_i stays free of response i's own weight.
Self-normalisation makes the baseline invariant to one scale per group, which
:func:`sequence_weights` uses to keep the weights finite (divided by the group's largest).

**Off-policy optimal baseline** (OPOB; Huang et al. 2026, VCPO §4). The baseline that minimises
the variance of the importance-weighted policy gradient Σ_i w_i (r_i − b) g_i, with g_i the
gradient row i contributes per unit of advantage (its score function ∇_θ log π_θ(y_i), weighed as
the loss aggregation weighs the row), is the mean of the rewards weighted by w_i² ‖g_i‖²:

    b*_g = Σ_j w_j² ‖g_j‖² r_j / Σ_j w_j² ‖g_j‖²

:func:`optimal_baseline_weights` forms those weights; the baseline then goes through the same
self-normalised means as above (RLOO leaves row i out). The trainer computes ‖g_i‖² with one
backward per row (``Scorer.score_sq_norms``); w_i are :func:`sequence_weights`, untruncated unless
``baseline_rho_bar`` is set (VCPO's default uses the untruncated ratio).

Everything is vectorised over groups with ``scatter_add`` (cost O(B)); the float64 reference in
``tests/support/reference_groups.py`` loops over groups.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Estimator = Literal["GRPO", "DrGRPO", "RLOO"]
ESTIMATORS: tuple[str, ...] = ("GRPO", "DrGRPO", "RLOO")


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(index [B] in 0..G−1, G)``: each row's group as a dense index."""
    _, index = torch.unique(group_ids, return_inverse=True)
    return index, int(index.max()) + 1 if len(index) else 0


def _group_sum(values: torch.Tensor, index: torch.Tensor, groups: int) -> torch.Tensor:
    """``[G]`` sums of ``values`` ``[B]`` per group."""
    return values.new_zeros(groups).scatter_add(0, index, values)


def check_group_inputs(
    rewards: torch.Tensor, group_ids: torch.Tensor, weights: torch.Tensor | None = None
) -> None:
    """Raise ValueError unless rewards ``[B]`` (float), group_ids ``[B]`` (int64) and weights
    ``[B]`` (finite, ≥ 0) line up."""
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(
            f"rewards must be a 1-D float tensor [B]; got shape {tuple(rewards.shape)} and dtype "
            f"{rewards.dtype}."
        )
    if group_ids.shape != rewards.shape or group_ids.dtype != torch.long:
        raise ValueError(
            f"group_ids must be an int64 tensor of shape {tuple(rewards.shape)} like rewards; got "
            f"shape {tuple(group_ids.shape)} and dtype {group_ids.dtype}."
        )
    if weights is not None:
        _require_per_row("weights", weights, "rewards", rewards.shape)


def _require_per_row(name: str, values: torch.Tensor, like: str, shape: torch.Size) -> None:
    """Raise ValueError unless ``values`` is finite, non-negative and of ``shape`` (``like``'s)."""
    if values.shape != shape or not bool(torch.isfinite(values).all()) or (values < 0).any():
        raise ValueError(
            f"{name} must be finite, non-negative and of shape {tuple(shape)} like {like}; got "
            f"shape {tuple(values.shape)}."
        )


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    estimator: Estimator,
    eps: float = 1e-6,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence advantages ``[B]`` (rewards' dtype) of the module docstring's estimators.

    Args:
        rewards: ``[B]`` sequence rewards.
        group_ids: ``[B]`` int64; rows with the same id form one prompt group (any order).
        estimator: ``"GRPO"``, ``"DrGRPO"`` or ``"RLOO"``.
        eps: added to GRPO's group std (≥ 0; TRL: 1e-4); unused by the others.
        weights: ``[B]`` importance weights of the self-normalised baseline (already truncated;
            only their ratios within a group matter), or None for the plain group mean.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}; got {estimator!r}.")
    if not isinstance(eps, int | float) or not 0.0 <= float(eps) < math.inf:
        raise ValueError(f"eps must be a finite number >= 0; got {eps!r}.")
    check_group_inputs(rewards, group_ids, weights)
    if len(rewards) == 0:
        return rewards.clone()
    index, groups = _group_index(group_ids)
    count = _group_sum(torch.ones_like(rewards), index, groups)
    w = torch.ones_like(rewards) if weights is None else weights.to(rewards.dtype)
    weight_sum = _group_sum(w, index, groups)
    weighted_sum = _group_sum(w * rewards, index, groups)
    alone = (count <= 1)[index]
    if estimator == "RLOO":
        others = weight_sum[index] - w
        baseline = (weighted_sum[index] - w * rewards) / torch.where(others > 0, others, 1.0)
        advantages = torch.where(others > 0, rewards - baseline, 0.0)
        return torch.where(alone, 0.0, advantages)
    baseline = weighted_sum / torch.where(weight_sum > 0, weight_sum, 1.0)
    advantages = torch.where(alone, 0.0, rewards - baseline[index])
    if estimator == "DrGRPO":
        return advantages
    mean = _group_sum(rewards, index, groups) / count
    squares = _group_sum((rewards - mean[index]) ** 2, index, groups)
    std = torch.sqrt(squares / (count - 1).clamp(min=1))
    return advantages / (std[index] + eps)


def sequence_weights(
    target_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    rho_bar: float | None,
) -> torch.Tensor:
    """``[B]`` truncated sequence importance weights min(ρ̄, π(y)/µ(y)), each group divided by its
    largest weight (the self-normalised baseline does not change; no weight over- or underflows).

    ``π(y)/µ(y) = exp Σ_t (log π − log µ)`` over the row's actions (``[B, T]`` inputs, ``mask``
    True at actions). The truncation is applied before the per-group scaling, so it acts on the
    true ratio; ``rho_bar=None`` keeps the ratio untruncated. A row without actions gets the
    ratio 1.
    """
    if rho_bar is not None and (
        not isinstance(rho_bar, int | float) or not 0.0 < float(rho_bar) < math.inf
    ):
        raise ValueError(f"rho_bar must be None or a positive finite number; got {rho_bar!r}.")
    log_weight = torch.where(mask, target_logprobs - behavior_logprobs, 0.0).sum(dim=1)
    if rho_bar is not None:
        log_weight = log_weight.clamp(max=math.log(rho_bar))
    return _scaled_to_group_peak(log_weight, group_ids)


def _scaled_to_group_peak(log_weight: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``exp(log_weight)`` ``[B]`` with each group divided by its largest weight (computed in log
    space, so no weight over- or underflows before the division); −inf gives 0."""
    index, groups = _group_index(group_ids)
    peak = log_weight.new_full((groups,), -math.inf).scatter_reduce(
        0, index, log_weight, reduce="amax"
    )
    peak = torch.where(torch.isfinite(peak), peak, 0.0)  # a group of zero weights stays zero
    return torch.exp(log_weight - peak[index])


def optimal_baseline_weights(
    ratio_weights: torch.Tensor, score_sq_norms: torch.Tensor, group_ids: torch.Tensor
) -> torch.Tensor:
    """``[B]`` weights w_i² ‖g_i‖² of the off-policy optimal baseline (module docstring), each
    group divided by its largest (only their ratios within a group matter).

    Args:
        ratio_weights: ``[B]`` sequence importance weights w_i (:func:`sequence_weights`), ≥ 0.
        score_sq_norms: ``[B]`` squared norms ‖g_i‖² of each row's score gradient, finite, ≥ 0.
        group_ids: ``[B]`` int64 prompt groups.
    """
    _require_per_row("ratio_weights", ratio_weights, "group_ids", group_ids.shape)
    _require_per_row("score_sq_norms", score_sq_norms, "group_ids", group_ids.shape)
    norms = score_sq_norms.to(torch.float64)
    log_weight = 2.0 * ratio_weights.to(torch.float64).log() + norms.log()  # log 0 = −inf: weight 0
    return _scaled_to_group_peak(log_weight, group_ids).to(ratio_weights.dtype)


def broadcast_to_actions(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` → ``[B, T]``: the row's value at each of its actions, 0 elsewhere."""
    return torch.where(mask, per_sequence[:, None], 0.0)
