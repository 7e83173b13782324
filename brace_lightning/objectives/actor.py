"""Config classes of the actor objectives: hyperparameters, validation, one functional call.

Selected in YAML with ``class_path`` (e.g. ``brace_lightning.objectives.IcePop``); each class's
``Args`` become LightningCLI's ``--help``. The formulas live in :mod:`.functional` only.
"""

from __future__ import annotations

import math

import torch

from brace_lightning.objectives import functional as F
from brace_lightning.objectives.base import ActorObjective, ObjectiveOutput


def _number(value: object) -> bool:
    # bool is an int subclass; True as a threshold is a config mistake, not 1.0.
    return isinstance(value, int | float) and not isinstance(value, bool)


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}; got {value!r}.")


def _positive(name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    expected = "a positive finite number" + (" or None" if optional else "")
    _require(_number(value) and 0.0 < value < math.inf, name, value, expected)


class _ReprFromArgs:
    """``repr`` as ``Name(arg=value, ...)`` from the instance's hyperparameters (its ``vars``)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class _Clipped(_ReprFromArgs, ActorObjective):
    """Shared PPO-clip hyperparameters of the objectives built on the PPO surrogate."""

    def __init__(self, *, clip_low: float, clip_high: float, dual_clip: float | None) -> None:
        _require(_number(clip_low) and 0.0 < clip_low < 1.0, "clip_low", clip_low, "in (0, 1)")
        _positive("clip_high", clip_high)
        _require(
            dual_clip is None or (_number(dual_clip) and 1.0 < dual_clip < math.inf),
            "dual_clip",
            dual_clip,
            "a finite number > 1 or None",
        )
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.dual_clip = dual_clip

    def _clip(self) -> dict[str, float | None]:
        return {"clip_low": self.clip_low, "clip_high": self.clip_high, "dual_clip": self.dual_clip}


class PPOClip(_Clipped):
    """PPO clip with clip-higher and optional dual clip; ignores µ (:func:`.functional.ppo_clip`).

    Args:
        clip_low: ε_low; the ratio π_θ/π_prox is clipped below at 1 − clip_low. In (0, 1).
        clip_high: ε_high; the ratio is clipped above at 1 + clip_high (clip-higher). Positive.
        dual_clip: c > 1: for A < 0 the token loss is capped at −c·A (Ye et al. 2020). None: off.
    """

    def __init__(
        self, *, clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = None
    ) -> None:
        super().__init__(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)

    def __call__(
        self,
        *,
        logprobs: torch.Tensor,
        proximal_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        return F.ppo_clip(logprobs, proximal_logprobs, advantages, mask, **self._clip())


class TIS(_Clipped):
    """PPO clip times the truncated behavior weight min(π_prox/µ, C) (:func:`.functional.tis`).

    Args:
        clip_low: ε_low; the ratio π_θ/π_prox is clipped below at 1 − clip_low. In (0, 1).
        clip_high: ε_high; the ratio is clipped above at 1 + clip_high (clip-higher). Positive.
        dual_clip: c > 1: for A < 0 the token loss is capped at −c·A (Ye et al. 2020). None: off.
        weight_cap: C, the truncation of the weight π_prox/µ. Positive.
    """

    def __init__(
        self,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        weight_cap: float = 2.0,
    ) -> None:
        super().__init__(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
        _positive("weight_cap", weight_cap)
        self.weight_cap = weight_cap

    def __call__(
        self,
        *,
        logprobs: torch.Tensor,
        proximal_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        return F.tis(
            logprobs,
            proximal_logprobs,
            behavior_logprobs,
            advantages,
            mask,
            **self._clip(),
            weight_cap=self.weight_cap,
        )


class DecoupledPPO(_Clipped):
    """Decoupled PPO: −ω·min(r A, clip(r) A), ω from w = π_prox/µ (:func:`.functional.decoupled_ppo`).

    The behavior weight w is always applied. Two rules bound it, each named for what it does:
    ``weight_cap`` C **truncates** (ω = min(w, C): every token keeps a loss, large weights count as
    C; TIS-style, Yao et al. 2025); ``weight_mask_above`` M **masks** (tokens with w > M get no
    loss, the others keep ω = w: AReaL's rule, its ``behav_imp_weight_cap``). Both together (M > C)
    truncate at C and drop tokens above M. Overlays: ``configs/objectives/decoupled/truncated.yaml``
    and ``decoupled/masked.yaml``.

    Args:
        clip_low: ε_low; the ratio π_θ/π_prox is clipped below at 1 − clip_low. In (0, 1).
        clip_high: ε_high; the ratio is clipped above at 1 + clip_high (clip-higher). Positive.
        dual_clip: c > 1: for A < 0 the token loss is capped at −c·A (Ye et al. 2020). None: off.
        weight_cap: truncation: w is cut to this value (TIS-style). Positive, or None for none.
        weight_mask_above: masking (AReaL): tokens with w above this value get no loss (they stay
            in the denominator). Positive and above ``weight_cap`` if both are set, or None.
    """

    def __init__(
        self,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        weight_cap: float | None = None,
        weight_mask_above: float | None = None,
    ) -> None:
        super().__init__(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
        _positive("weight_cap", weight_cap, optional=True)
        _positive("weight_mask_above", weight_mask_above, optional=True)
        if weight_cap is not None and weight_mask_above is not None:
            # Kept tokens have w <= weight_mask_above <= weight_cap: the cap would never act.
            _require(
                weight_mask_above > weight_cap,
                "weight_mask_above",
                weight_mask_above,
                f"above weight_cap={weight_cap!r} when both are set (else the cap never acts)",
            )
        self.weight_cap = weight_cap
        self.weight_mask_above = weight_mask_above

    def __call__(
        self,
        *,
        logprobs: torch.Tensor,
        proximal_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        return F.decoupled_ppo(
            logprobs,
            proximal_logprobs,
            behavior_logprobs,
            advantages,
            mask,
            **self._clip(),
            weight_cap=self.weight_cap,
            weight_mask_above=self.weight_mask_above,
        )


class PPOEWMA(DecoupledPPO):
    """PPO-EWMA (Hilton et al. 2021): decoupled PPO whose π_prox is an EWMA of the actor's weights.

    Same loss as :class:`DecoupledPPO`; ``ewma_decay`` tells the LightningModule to keep the EWMA
    copy (bias-corrected) and pass its log-probs as ``proximal_logprobs``.

    Args:
        ewma_decay: β in θ_ewma ← β θ_ewma + (1 − β) θ after each optimizer step. In (0, 1).
        clip_low: ε_low; the ratio π_θ/π_prox is clipped below at 1 − clip_low. In (0, 1).
        clip_high: ε_high; the ratio is clipped above at 1 + clip_high (clip-higher). Positive.
        dual_clip: c > 1: for A < 0 the token loss is capped at −c·A (Ye et al. 2020). None: off.
        weight_cap: truncation: w = π_prox/µ is cut to this value. Positive, or None for none.
        weight_mask_above: masking (AReaL): tokens with w above this value get no loss (they stay
            in the denominator). Positive and above ``weight_cap`` if both are set, or None.
    """

    def __init__(
        self,
        *,
        ewma_decay: float = 0.9,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        weight_cap: float | None = None,
        weight_mask_above: float | None = None,
    ) -> None:
        super().__init__(
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=dual_clip,
            weight_cap=weight_cap,
            weight_mask_above=weight_mask_above,
        )
        _require(
            _number(ewma_decay) and 0.0 < ewma_decay < 1.0, "ewma_decay", ewma_decay, "in (0, 1)"
        )
        self.ewma_decay = ewma_decay


class GSPO(_ReprFromArgs, ActorObjective):
    """GSPO: the PPO clip on the sequence-level (geometric-mean) ratio
    s_i = exp(mean_t log π_θ/π_prox) of each row (:func:`.functional.gspo`, GSPO-token form).

    Args:
        clip_low: s_i is clipped below at 1 − clip_low. In (0, 1) (GSPO: 3e-4).
        clip_high: s_i is clipped above at 1 + clip_high. Positive (GSPO: 4e-4).
        behavior_weight_cap: C: weight each row's loss by min(w_i, C), w_i the geometric mean of
            π_prox/µ over its actions (for stale samples). Positive, or None (GSPO as published).
    """

    def __init__(
        self,
        *,
        clip_low: float = 3e-4,
        clip_high: float = 4e-4,
        behavior_weight_cap: float | None = None,
    ) -> None:
        _require(_number(clip_low) and 0.0 < clip_low < 1.0, "clip_low", clip_low, "in (0, 1)")
        _positive("clip_high", clip_high)
        _positive("behavior_weight_cap", behavior_weight_cap, optional=True)
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.behavior_weight_cap = behavior_weight_cap

    def __call__(
        self,
        *,
        logprobs: torch.Tensor,
        proximal_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        return F.gspo(
            logprobs,
            proximal_logprobs,
            behavior_logprobs,
            advantages,
            mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            behavior_weight_cap=self.behavior_weight_cap,
        )


class IcePop(_Clipped):
    """IcePop: PPO clip times w·1[α ≤ w ≤ β], w = π_prox/µ (:func:`.functional.icepop`).

    Args:
        clip_low: ε_low; the ratio π_θ/π_prox is clipped below at 1 − clip_low. In (0, 1).
        clip_high: ε_high; the ratio is clipped above at 1 + clip_high (clip-higher). Positive.
        dual_clip: c > 1: for A < 0 the token loss is capped at −c·A (Ye et al. 2020). None: off.
        alpha: lower end of the kept band of w. In (0, 1].
        beta: upper end of the kept band of w. At least 1 and finite.
    """

    def __init__(
        self,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        alpha: float = 0.5,
        beta: float = 5.0,
    ) -> None:
        super().__init__(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
        # The band must contain w = 1, or on-policy tokens would be rejected.
        _require(_number(alpha) and 0.0 < alpha <= 1.0, "alpha", alpha, "in (0, 1]")
        _require(_number(beta) and 1.0 <= beta < math.inf, "beta", beta, "a finite number >= 1")
        self.alpha = alpha
        self.beta = beta

    def __call__(
        self,
        *,
        logprobs: torch.Tensor,
        proximal_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        return F.icepop(
            logprobs,
            proximal_logprobs,
            behavior_logprobs,
            advantages,
            mask,
            **self._clip(),
            alpha=self.alpha,
            beta=self.beta,
        )


class KPop(_Clipped):
    """KPop: PPO clip on tokens whose symmetric binary KL between π_prox(y) and µ(y) is ≤ τ
    (:func:`.functional.kpop`).

    Args:
        clip_low: ε_low; the ratio π_θ/π_prox is clipped below at 1 − clip_low. In (0, 1).
        clip_high: ε_high; the ratio is clipped above at 1 + clip_high (clip-higher). Positive.
        dual_clip: c > 1: for A < 0 the token loss is capped at −c·A (Ye et al. 2020). None: off.
        kl_threshold: τ, the largest max(KL_bin(p‖q), KL_bin(q‖p)) a kept token may have. Positive.
    """

    def __init__(
        self,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        kl_threshold: float = 0.1,
    ) -> None:
        super().__init__(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
        _positive("kl_threshold", kl_threshold)
        self.kl_threshold = kl_threshold

    def __call__(
        self,
        *,
        logprobs: torch.Tensor,
        proximal_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        return F.kpop(
            logprobs,
            proximal_logprobs,
            behavior_logprobs,
            advantages,
            mask,
            **self._clip(),
            kl_threshold=self.kl_threshold,
        )


class DIS(ActorObjective):
    """Direct importance sampling (SAO): −(π_θ/µ)·A on tokens with π_θ/µ inside
    (1 − eps_low, 1 + eps_high), 0 elsewhere; no π_prox, no PPO clip (:func:`.functional.dis`).

    Args:
        eps_low: the band's lower end is 1 − eps_low. In (0, 1].
        eps_high: the band's upper end is 1 + eps_high. Positive.
    """

    def __init__(self, *, eps_low: float = 0.3, eps_high: float = 5.0) -> None:
        _require(_number(eps_low) and 0.0 < eps_low <= 1.0, "eps_low", eps_low, "in (0, 1]")
        _positive("eps_high", eps_high)
        self.eps_low = eps_low
        self.eps_high = eps_high

    def __call__(
        self,
        *,
        logprobs: torch.Tensor,
        proximal_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        return F.dis(
            logprobs,
            behavior_logprobs,
            advantages,
            mask,
            eps_low=self.eps_low,
            eps_high=self.eps_high,
        )

    def __repr__(self) -> str:
        return f"DIS(eps_low={self.eps_low!r}, eps_high={self.eps_high!r})"


class ESTR(_Clipped):
    """ESTR: PPO clip on tokens with (log π_θ/µ)² / (H_µ + eps) ≤ τ (:func:`.functional.estr`).

    Needs the engine's per-token entropy H_µ (``needs_entropy``).

    Args:
        clip_low: ε_low; the ratio π_θ/π_prox is clipped below at 1 − clip_low. In (0, 1).
        clip_high: ε_high; the ratio is clipped above at 1 + clip_high (clip-higher). Positive.
        dual_clip: c > 1: for A < 0 the token loss is capped at −c·A (Ye et al. 2020). None: off.
        threshold: τ, the largest score a kept token may have. Positive.
        eps: added to H_µ in the denominator. Positive.
    """

    needs_entropy = True

    def __init__(
        self,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        threshold: float = 1.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
        _positive("threshold", threshold)
        _positive("eps", eps)
        self.threshold = threshold
        self.eps = eps

    def __call__(
        self,
        *,
        logprobs: torch.Tensor,
        proximal_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        if entropy is None:
            raise ValueError(
                "entropy must be the engine's per-token entropy [B, T] for ESTR; got None."
            )
        return F.estr(
            logprobs,
            proximal_logprobs,
            behavior_logprobs,
            entropy,
            advantages,
            mask,
            **self._clip(),
            threshold=self.threshold,
            eps=self.eps,
        )
