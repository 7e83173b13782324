"""Actor-side objectives and the critic loss as pure functions of per-token tensors.

Conventions (``docs/conventions.md``): every tensor is ``[B, T]``; ``mask`` is bool, True at actions.
Every loss function returns :class:`~brace_lightning.objectives.base.ObjectiveOutput` whose
``token_loss`` is to be **minimised**, is 0 at non-actions and at tokens a rule rejects; the
LightningModule sums it and divides by the global action-token count, so rejected tokens stay in
that denominator. :func:`binary_kl` and :func:`kl_to_reference` (the KL to a frozen reference
policy, a loss term or reward penalty of the module) return plain per-token tensors.

Notation: µ behavior policy (engine), π_prox the trainer's policy at the start of the step, π_θ the
current policy, A the advantage, r = π_θ/π_prox, w = π_prox/µ,
clip(r) = clamp(r, 1 − clip_low, 1 + clip_high).

Numerics, shared by all functions:

- Only ``logprobs`` / ``values`` carry gradient; every other input is detached.
- Inputs are zeroed at non-actions before any arithmetic, so NaN/inf there reaches neither the loss
  nor the gradient; work is done in float32 at least.
- Every ratio is exp(clamp(log-ratio, −20, 20)), so finite log-probs never give inf/NaN. Past the
  clamp (ratios beyond e^20 ≈ 4.9e8) the gradient is 0.
- Hyperparameters are validated by the config classes (:mod:`.actor`, :mod:`.critic`); these
  functions trust them. Tensors are checked: a bad shape, dtype, device or a non-finite value at an
  action raises ValueError (one device sync per call).

Stats (detached scalars, float32 at least) follow one naming rule so the module can reduce them
across micro-batches: ``*_count`` token counts and ``*_sum`` sums over this micro-batch's actions
(divide by the action count for a fraction/mean), ``*_max`` maxima over its actions (0 if none).
"""

from __future__ import annotations

import functools
import math

import torch

from brace_lightning.objectives.base import ObjectiveOutput

MAX_LOG_RATIO = 20.0
"""Every log-ratio of the package is clamped to ±MAX_LOG_RATIO before exp (the kernels here and the
trainer's importance weights), so finite log-probs never give an inf ratio."""

_DIFFERENTIABLE = frozenset({"logprobs", "values"})


def _prepare(mask: torch.Tensor, **tensors: torch.Tensor) -> list[torch.Tensor]:
    """Check shapes/dtypes/finiteness, then return the tensors in a common float dtype (float32 at
    least), zeroed at non-actions and detached unless named in ``_DIFFERENTIABLE``."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a torch.bool tensor (True at actions); got {what}.")
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape [B, T]; got {tuple(mask.shape)}.")
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a floating-point tensor; got {what}.")
        if x.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {tuple(mask.shape)}.")
        if x.device != mask.device:
            raise ValueError(f"{name} is on {x.device}; expected {mask.device} like mask.")
    # One sync for all finiteness checks instead of one per tensor.
    bad = torch.stack([(mask & ~torch.isfinite(x)).any() for x in tensors.values()]).tolist()
    for name, is_bad in zip(tensors, bad, strict=True):
        if is_bad:
            raise ValueError(f"{name} has non-finite values at action positions; expected finite.")
    dtype = functools.reduce(
        torch.promote_types, (x.dtype for x in tensors.values()), torch.float32
    )
    out = []
    for name, x in tensors.items():
        x = x.to(dtype) if name in _DIFFERENTIABLE else x.detach().to(dtype)
        # where (not multiply) so that garbage at non-actions gives 0, and its gradient 0, not NaN.
        out.append(torch.where(mask, x, 0.0))
    return out


def _log_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return torch.clamp(numerator - denominator, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def _count(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # The appended 0 makes an all-False mask (or an empty batch) give 0 rather than an error.
    return torch.cat([torch.where(mask, x, 0.0).flatten(), x.new_zeros(1)]).amax()


def _finish(
    token_loss: torch.Tensor, stats: dict[str, torch.Tensor], mask: torch.Tensor
) -> ObjectiveOutput:
    token_loss = torch.where(mask, token_loss, 0.0)
    return ObjectiveOutput(
        token_loss, {k: v.detach().to(token_loss.dtype) for k, v in stats.items()}
    )


def _policy_shift_stats(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``ratio_sum`` Σ r and ``approx_kl_sum`` Σ (r − 1) − log r over all actions, r = π_θ/π_prox.

    The k3 estimator (Schulman 2020, "Approximating KL divergence") of KL(π_prox ‖ π_θ) on tokens
    drawn from µ ≈ π_prox; nonnegative per token.
    """
    log_ratio = log_ratio.detach()
    ratio = torch.exp(log_ratio)
    return {
        "ratio_sum": torch.where(mask, ratio, 0.0).sum(),
        "approx_kl_sum": torch.where(mask, ratio - 1.0 - log_ratio, 0.0).sum(),
    }


def _weight_stats(weight: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    weight = weight.detach()
    return {
        "weight_sum": torch.where(mask, weight, 0.0).sum(),
        "weight_max": _masked_max(weight, mask),
    }


def _clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Unmasked per-token PPO loss ``[B, T]`` and clip counts over the ``keep`` tokens.

    loss = max(−r A, −clip(r) A), and with dual clip c, for A < 0: min(loss, −c A).
    """
    ratio = torch.exp(log_ratio)
    surrogate = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(surrogate, clipped)
    # The clipped branch is strictly larger exactly where the clip removes the gradient:
    # A > 0 with r > 1 + clip_high, or A < 0 with r < 1 − clip_low.
    clip_active = keep & (clipped > surrogate)
    stats = {
        "clip_low_count": _count(clip_active & (ratio < 1.0)),
        "clip_high_count": _count(clip_active & (ratio > 1.0)),
    }
    if dual_clip is None:
        stats["dual_clip_count"] = torch.zeros((), device=loss.device)
        return loss, stats
    cap = -dual_clip * advantages
    capped = (advantages < 0) & (loss > cap)
    stats["dual_clip_count"] = _count(keep & capped)
    return torch.where(capped, cap, loss), stats


def _weighted_ppo(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    keep: torch.Tensor,
    weight: torch.Tensor | float,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """weight · PPO loss on ``keep`` (⊆ mask), 0 elsewhere; PPO stats and ``masked_count``."""
    log_ratio = _log_ratio(logprobs, proximal_logprobs)
    loss, stats = _clipped_surrogate(
        log_ratio, advantages, keep, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    stats |= _policy_shift_stats(log_ratio, mask)
    stats["masked_count"] = _count(mask & ~keep)
    return torch.where(keep, weight * loss, 0.0), stats


def ppo_clip(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> ObjectiveOutput:
    """PPO clipped surrogate with clip-higher and optional dual clip, per token.

    loss_t = −min(r_t A_t, clip(r_t) A_t),  r_t = π_θ(y_t)/π_prox(y_t),
    clip(r) = clamp(r, 1 − clip_low, 1 + clip_high); with ``dual_clip`` c > 1 and A_t < 0 the loss
    is further capped at −c A_t.

    Sources: Schulman et al. 2017 (PPO); clip-higher from DAPO (Yu et al. 2025, 0.2 / 0.28); dual
    clip from Ye et al. 2020 ("Mastering Complex Control in MOBA Games"), as in verl's
    ``compute_policy_loss``.

    Args:
        logprobs: ``[B, T]`` log π_θ of the taken tokens (differentiable).
        proximal_logprobs: ``[B, T]`` log π_prox.
        advantages: ``[B, T]`` A.
        mask: ``[B, T]`` bool, True at actions.
        clip_low, clip_high, dual_clip: as above.

    Returns:
        ``token_loss`` ``[B, T]``; stats ``clip_low_count`` (A < 0, r < 1 − clip_low),
        ``clip_high_count`` (A > 0, r > 1 + clip_high), ``dual_clip_count``, ``ratio_sum``,
        ``approx_kl_sum`` (k3 estimate of KL(π_prox ‖ π_θ)).
    """
    logprobs, proximal_logprobs, advantages = _prepare(
        mask, logprobs=logprobs, proximal_logprobs=proximal_logprobs, advantages=advantages
    )
    log_ratio = _log_ratio(logprobs, proximal_logprobs)
    loss, stats = _clipped_surrogate(
        log_ratio, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    return _finish(loss, stats | _policy_shift_stats(log_ratio, mask), mask)


def decoupled_ppo(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    weight_cap: float | None = None,
    weight_mask_above: float | None = None,
) -> ObjectiveOutput:
    """Decoupled PPO: the PPO loss on π_θ/π_prox times the behavior weight w = π_prox/µ.

    loss_t = ω_t · ppo_t,  ω_t = min(w_t, weight_cap) (or w_t if ``weight_cap`` is None),
    and loss_t = 0 where w_t > ``weight_mask_above`` (if set; the token stays in the denominator).
    Two different rules: ``weight_cap`` *truncates* w (TIS-style: every token keeps a loss) and
    ``weight_mask_above`` *masks* tokens (AReaL's ``behav_imp_weight_cap``: they lose their loss).
    ppo_t is :func:`ppo_clip`'s token loss. The weight is always applied and is a constant
    (no gradient).

    Sources: Hilton et al. 2021 ("Batch size-invariance for policy optimization") and AReaL
    (Fu et al. 2025, decoupled PPO). Unlike AReaL, w is applied whether or not a threshold is set.
    PPO-EWMA is this function with π_prox from an EWMA of the actor's weights.

    Args:
        logprobs: ``[B, T]`` log π_θ (differentiable).
        proximal_logprobs: ``[B, T]`` log π_prox.
        behavior_logprobs: ``[B, T]`` log µ.
        advantages: ``[B, T]`` A.
        mask: ``[B, T]`` bool, True at actions.
        clip_low, clip_high, dual_clip: as in :func:`ppo_clip`.
        weight_cap: truncation of w (TIS-style), or None.
        weight_mask_above: masking: tokens with w above it are rejected (AReaL), or None.

    Returns:
        ``token_loss`` ``[B, T]``; :func:`ppo_clip`'s stats (clip counts over kept tokens) plus
        ``weight_sum`` / ``weight_max`` (raw w), ``truncated_count`` (kept tokens with
        w > weight_cap), ``masked_count``.
    """
    logprobs, proximal_logprobs, behavior_logprobs, advantages = _prepare(
        mask,
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        behavior_logprobs=behavior_logprobs,
        advantages=advantages,
    )
    w = torch.exp(_log_ratio(proximal_logprobs, behavior_logprobs))
    keep = mask if weight_mask_above is None else mask & (w <= weight_mask_above)
    weight = w if weight_cap is None else torch.clamp(w, max=weight_cap)
    loss, stats = _weighted_ppo(
        logprobs,
        proximal_logprobs,
        advantages,
        mask,
        keep,
        weight,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )
    truncated = keep & (w > weight_cap) if weight_cap is not None else torch.zeros_like(mask)
    stats |= _weight_stats(w, mask) | {"truncated_count": _count(truncated)}
    return _finish(loss, stats, mask)


def tis(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    weight_cap: float = 2.0,
) -> ObjectiveOutput:
    """Truncated importance sampling: the PPO loss on π_θ/π_prox times min(π_prox/µ, C).

    loss_t = min(w_t, C) · ppo_t,  C = ``weight_cap``.

    This is exactly :func:`decoupled_ppo` with ``weight_cap=C`` and no masking, so it calls it.
    Source: Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL
    training", TIS, C = 2). Args, returns and stats as :func:`decoupled_ppo`.
    """
    return decoupled_ppo(
        logprobs,
        proximal_logprobs,
        behavior_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        weight_cap=weight_cap,
    )


def icepop(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    alpha: float = 0.5,
    beta: float = 5.0,
) -> ObjectiveOutput:
    """IcePop: two-sided token mask on w = π_prox/µ; kept tokens are weighted by w.

    loss_t = w_t · 1[α ≤ w_t ≤ β] · ppo_t; tokens outside [α, β] get zero loss and no gradient and
    stay in the denominator. The weight w is a constant (no gradient).

    Source: Ring-1T report (Ling Team 2025, "IcePop"), α = 0.5, β = 5, as summarised in
    ``docs/conventions.md``. Args as :func:`decoupled_ppo` with ``alpha``/``beta`` the band.

    Returns:
        ``token_loss`` ``[B, T]``; :func:`ppo_clip`'s stats plus ``weight_sum`` / ``weight_max``
        (raw w) and ``masked_count``.
    """
    logprobs, proximal_logprobs, behavior_logprobs, advantages = _prepare(
        mask,
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        behavior_logprobs=behavior_logprobs,
        advantages=advantages,
    )
    w = torch.exp(_log_ratio(proximal_logprobs, behavior_logprobs))
    keep = mask & (w >= alpha) & (w <= beta)
    loss, stats = _weighted_ppo(
        logprobs,
        proximal_logprobs,
        advantages,
        mask,
        keep,
        w,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )
    return _finish(loss, stats | _weight_stats(w, mask), mask)


def _row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` mean of ``x`` over each row's actions (0 for a row without one)."""
    return torch.where(mask, x, 0.0).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)


def gspo(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    behavior_weight_cap: float | None = None,
) -> ObjectiveOutput:
    """GSPO: the PPO clip on one sequence-level (geometric-mean) ratio per row, GSPO-token form.

    s_i = exp(mean_{t ∈ y_i} log(π_θ(y_t)/π_prox(y_t))), the ratio of row i's length-normalised
    likelihoods; every action t of the row gets s_{i,t} = sg[s_i] · π_θ(y_t)/sg[π_θ(y_t)] (value
    s_i, gradient s_i ∇log π_θ(y_t)) and loss_t = −min(s_{i,t} A_t, clip(s_{i,t}) A_t), so a row
    is clipped whole or not at all. With an advantage constant along each row this is GSPO's
    sequence loss and gradient; with per-token advantages (a critic's) each token keeps its own.

    ``behavior_weight_cap`` C (optional) adds the sequence's behaviour weight for stale samples:
    loss_t is multiplied by min(w_i, C), w_i = exp(mean_t log(π_prox(y_t)/µ(y_t))), the same
    geometric mean of the decoupled weight (a constant, no gradient). None: no behaviour weight,
    GSPO as published with π_prox as its old policy.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (eq. 5–7 and GSPO-token,
    clip 3e-4 / 4e-4). The sum over tokens divided by the global action-token count replaces
    GSPO's 1/|y_i| (one normalisation for every objective here).

    Args:
        logprobs: ``[B, T]`` log π_θ (differentiable).
        proximal_logprobs: ``[B, T]`` log π_prox.
        behavior_logprobs: ``[B, T]`` log µ.
        advantages: ``[B, T]`` A.
        mask: ``[B, T]`` bool, True at actions.
        clip_low, clip_high: s_i is clipped to [1 − clip_low, 1 + clip_high].
        behavior_weight_cap: C > 0, or None.

    Returns:
        ``token_loss`` ``[B, T]``; stats ``clip_low_count`` / ``clip_high_count`` (tokens of
        clipped rows), ``sequence_ratio_sum`` (s_i per token), ``ratio_sum`` and
        ``approx_kl_sum`` (token-level, as :func:`ppo_clip`), and with a cap ``weight_sum`` /
        ``weight_max`` (w_i per token) and ``truncated_count`` (tokens of rows with w_i > C).
    """
    logprobs, proximal_logprobs, behavior_logprobs, advantages = _prepare(
        mask,
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        behavior_logprobs=behavior_logprobs,
        advantages=advantages,
    )
    token_log_ratio = _log_ratio(logprobs, proximal_logprobs)
    log_s = _row_mean(token_log_ratio.detach(), mask)  # [B, 1]
    log_ratio = log_s + (logprobs - logprobs.detach())  # value log s_i, gradient ∇log π_θ(y_t)
    loss, stats = _clipped_surrogate(
        log_ratio, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=None
    )
    del stats["dual_clip_count"]
    stats |= _policy_shift_stats(token_log_ratio, mask)
    stats["sequence_ratio_sum"] = torch.where(mask, torch.exp(log_s), 0.0).sum()
    if behavior_weight_cap is not None:
        w = torch.exp(_row_mean(_log_ratio(proximal_logprobs, behavior_logprobs), mask))
        w = w.expand_as(mask)
        loss = torch.clamp(w, max=behavior_weight_cap) * loss
        stats |= _weight_stats(w, mask) | {
            "truncated_count": _count(mask & (w > behavior_weight_cap))
        }
    return _finish(loss, stats, mask)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − e^x) for x < 0, accurate at both ends (Mächler 2012)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def binary_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL between Bernoulli(p) and Bernoulli(q) from log p and log q, elementwise.

    KL_bin(p ‖ q) = p log(p/q) + (1 − p) log((1 − p)/(1 − q)).

    log(1 − p) is computed with expm1/log1p, and log p, log q are clamped to at most −tiny (the
    dtype's smallest normal number), so p, q → 1 give large but finite values, never NaN.
    """
    limit = -torch.finfo(log_p.dtype).tiny
    log_p, log_q = torch.clamp(log_p, max=limit), torch.clamp(log_q, max=limit)
    log1m_p, log1m_q = _log1mexp(log_p), _log1mexp(log_q)
    return torch.exp(log_p) * (log_p - log_q) + torch.exp(log1m_p) * (log1m_p - log1m_q)


def kpop(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    kl_threshold: float = 0.1,
) -> ObjectiveOutput:
    """KPop: keep a token iff the symmetric binary KL between π_prox(y_t) and µ(y_t) is ≤ τ.

    keep_t = max(KL_bin(p_t ‖ q_t), KL_bin(q_t ‖ p_t)) ≤ τ,  p_t = π_prox(y_t), q_t = µ(y_t);
    loss_t = 1[keep_t] · ppo_t (no importance weight). Unlike a fixed ratio band, the band on
    p/q adapts to the token's probability: rare tokens may move further in ratio.

    Source: Ant Group's KPop note (Guo, Sun et al. 2026, successor of IcePop), as summarised in
    ``docs/conventions.md``. Args as :func:`decoupled_ppo` with ``kl_threshold`` = τ.

    Returns:
        ``token_loss`` ``[B, T]``; :func:`ppo_clip`'s stats plus ``weight_sum`` / ``weight_max``
        (w = p/q), ``binary_kl_sum`` (the symmetric binary KL) and ``masked_count``.
    """
    logprobs, proximal_logprobs, behavior_logprobs, advantages = _prepare(
        mask,
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        behavior_logprobs=behavior_logprobs,
        advantages=advantages,
    )
    kl = torch.maximum(
        binary_kl(proximal_logprobs, behavior_logprobs),
        binary_kl(behavior_logprobs, proximal_logprobs),
    )
    keep = mask & (kl <= kl_threshold)
    loss, stats = _weighted_ppo(
        logprobs,
        proximal_logprobs,
        advantages,
        mask,
        keep,
        1.0,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )
    w = torch.exp(_log_ratio(proximal_logprobs, behavior_logprobs))
    stats |= _weight_stats(w, mask) | {"binary_kl_sum": torch.where(mask, kl, 0.0).sum()}
    return _finish(loss, stats, mask)


def dis(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
) -> ObjectiveOutput:
    """Direct importance sampling: loss −(π_θ/µ)·A on tokens whose ratio lies in a band.

    ρ_t = π_θ(y_t)/µ(y_t);  loss_t = −ρ_t A_t if 1 − eps_low < ρ_t < 1 + eps_high, else 0 (no
    gradient; the token stays in the denominator). The band test uses the detached ratio. There is
    no proximal policy and no PPO clip: the band is the trust region.

    Source: SAO (Hou et al. 2026), math setting eps_low = 0.3, eps_high = 5.0, as summarised in
    ``docs/conventions.md``.

    Args:
        logprobs: ``[B, T]`` log π_θ (differentiable).
        behavior_logprobs: ``[B, T]`` log µ.
        advantages: ``[B, T]`` A.
        mask: ``[B, T]`` bool, True at actions.
        eps_low, eps_high: the open band (1 − eps_low, 1 + eps_high) on ρ.

    Returns:
        ``token_loss`` ``[B, T]``; stats ``weight_sum`` / ``weight_max`` (ρ), ``masked_count``.
    """
    logprobs, behavior_logprobs, advantages = _prepare(
        mask, logprobs=logprobs, behavior_logprobs=behavior_logprobs, advantages=advantages
    )
    ratio = torch.exp(_log_ratio(logprobs, behavior_logprobs))
    band = (ratio.detach() > 1.0 - eps_low) & (ratio.detach() < 1.0 + eps_high)
    keep = mask & band
    loss = torch.where(keep, -ratio * advantages, 0.0)
    stats = _weight_stats(ratio, mask) | {"masked_count": _count(mask & ~keep)}
    return _finish(loss, stats, mask)


def estr(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    threshold: float = 1.0,
    eps: float = 1e-6,
) -> ObjectiveOutput:
    """ESTR: reject tokens whose squared log-ratio to µ is large relative to µ's entropy.

    s_t = (log π_θ(y_t) − log µ(y_t))² / (H_µ,t + eps);  loss_t = 1[s_t ≤ τ] · ppo_t.
    s_t uses detached log-probs (the mask carries no gradient). A confident engine (small H_µ)
    tolerates only small log-ratios; an uncertain one tolerates larger ones. Negative entropies
    (float rounding) are treated as 0.

    Source: ESTR (Zhao et al. 2026), as summarised in ``docs/conventions.md``.

    Args:
        logprobs, proximal_logprobs, behavior_logprobs, advantages, mask: as in
            :func:`decoupled_ppo`.
        entropy: ``[B, T]`` H_µ, the engine's entropy at each action.
        clip_low, clip_high, dual_clip: as in :func:`ppo_clip`.
        threshold: τ.
        eps: added to H_µ so near-deterministic tokens do not divide by 0.

    Returns:
        ``token_loss`` ``[B, T]``; :func:`ppo_clip`'s stats plus ``weight_sum`` / ``weight_max``
        (π_θ/µ), ``score_sum`` (Σ s_t) and ``masked_count``.
    """
    logprobs, proximal_logprobs, behavior_logprobs, entropy, advantages = _prepare(
        mask,
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        behavior_logprobs=behavior_logprobs,
        entropy=entropy,
        advantages=advantages,
    )
    log_w = _log_ratio(logprobs.detach(), behavior_logprobs)
    score = log_w.square() / (torch.clamp(entropy, min=0.0) + eps)
    keep = mask & (score <= threshold)
    loss, stats = _weighted_ppo(
        logprobs,
        proximal_logprobs,
        advantages,
        mask,
        keep,
        1.0,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )
    stats |= _weight_stats(torch.exp(log_w), mask) | {
        "score_sum": torch.where(mask, score, 0.0).sum()
    }
    return _finish(loss, stats, mask)


#: Per-token estimators of KL(π_θ ‖ π_ref) accepted by :func:`kl_to_reference`.
KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_to_reference(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: str = "k3",
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) on the taken tokens, 0 at non-actions.

    With ℓ = log π_θ(y) − log π_ref(y) (clamped to ±20 like every log-ratio here) and
    r = π_ref/π_θ = exp(−ℓ):

    - ``"k1"``: ℓ (unbiased for tokens drawn from π_θ, can be negative per token);
    - ``"k2"``: ½ ℓ² (biased, non-negative; its gradient is that of a squared log-ratio);
    - ``"k3"``: r − 1 − log r = exp(−ℓ) − 1 + ℓ (unbiased and non-negative per token).

    Source: Schulman 2020, "Approximating KL divergence"; the same estimators as verl's
    ``kl_penalty`` (``kl``, ``mse``, ``low_var_kl``) and OpenRLHF's ``compute_approx_kl``. Used as a
    loss term (GRPO, verl ``use_kl_loss``) or as a reward penalty (OpenRLHF, TRL PPO) by the
    LightningModule.

    Args:
        logprobs: ``[B, T]`` log π_θ of the taken tokens (differentiable: the gradient of the
            estimate flows into it).
        reference_logprobs: ``[B, T]`` log π_ref of the same tokens (detached).
        mask: ``[B, T]`` bool, True at actions.
        estimator: one of :data:`KL_ESTIMATORS`.

    Returns:
        ``[B, T]`` per-token KL estimates in float32 at least, 0 at non-actions.

    Raises:
        ValueError: for an unknown ``estimator``, or (as every function here) a bad shape, dtype,
            device or a non-finite value at an action.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}.")
    logprobs, reference_logprobs = _prepare(
        mask, logprobs=logprobs, reference_logprobs=reference_logprobs
    )
    log_ratio = _log_ratio(logprobs, reference_logprobs)
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.exp(-log_ratio) - 1.0 + log_ratio
    return torch.where(mask, kl, 0.0)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.5,
) -> ObjectiveOutput:
    """Clipped value regression, per token.

    loss_t = ½ · max((V_t − y_t)², (clamp(V_t, V_old,t − ε, V_old,t + ε) − y_t)²),  ε = ``clip``;
    ``clip=None`` gives ½ (V_t − y_t)².

    Source: the PPO2 baselines value clip (also AReaL, verl, OpenRLHF; ε = 0.5 in the BRACE paper).

    Args:
        values: ``[B, T]`` V_t from the critic being trained (differentiable).
        old_values: ``[B, T]`` V_old,t, the critic's values when the targets were computed.
        returns: ``[B, T]`` y_t, the regression target (GAE / V-trace / BRACE returns).
        mask: ``[B, T]`` bool, True at actions.
        clip: ε, or None for no clipping.

    Returns:
        ``token_loss`` ``[B, T]``; stats ``value_clip_count`` (actions where the clipped error is
        strictly larger, i.e. the gradient is cut) and ``squared_error_sum`` (Σ (V − y)²).
    """
    values, old_values, returns = _prepare(
        mask, values=values, old_values=old_values, returns=returns
    )
    error = (values - returns).square()
    if clip is None:
        loss, clip_count = error, torch.zeros((), device=error.device)
    else:
        clipped_values = torch.clamp(values, old_values - clip, old_values + clip)
        clipped_error = (clipped_values - returns).square()
        loss = torch.maximum(error, clipped_error)
        clip_count = _count(mask & (clipped_error > error))
    stats = {
        "value_clip_count": clip_count,
        "squared_error_sum": torch.where(mask, error, 0.0).sum(),
    }
    return _finish(0.5 * loss, stats, mask)
