"""Slow float64 references for the actor objectives and the critic loss, one token at a time.

Each loss is written from its formula as a per-token loop: the weights and keep rules in plain
Python floats (``math``), the differentiable part as 0-d torch tensors so that autograd gives the
reference gradient. No clamping of log-ratios: the inputs here are moderate by construction.
Returns ``(token_loss [B, T], counts)``, counts being the rule's ``masked_count`` and the PPO clip
counts as Python ints.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Tensor = torch.Tensor


def ppo_token(
    logprob: Tensor,
    proximal: float,
    advantage: float,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, str | None]:
    """−min(r A, clip(r) A), and for A < 0 with dual clip c: −max(min(r A, clip(r) A), c A).

    Also returns the name of the count of the clip that decided the value, or None."""
    r = torch.exp(logprob - proximal)
    r_clipped = min(max(r, _const(1.0 - clip_low)), _const(1.0 + clip_high))
    unclipped_obj = r * advantage
    clipped_obj = r_clipped * advantage
    objective = min(unclipped_obj, clipped_obj)
    which = None
    if _val(clipped_obj) < _val(unclipped_obj):
        which = "clip_high_count" if _val(r) > 1 else "clip_low_count"
    if dual_clip is not None and advantage < 0 and _val(objective) < dual_clip * advantage:
        objective = _const(dual_clip * advantage)
        which = "dual_clip_count"
    return -objective, which


def _const(x: float) -> Tensor:
    return torch.tensor(x, dtype=torch.float64)


def _val(x: Tensor) -> float:
    return float(x.detach())


def _loop(
    mask: Tensor, per_token: Callable[[int, int], tuple[Tensor | None, str | None]]
) -> tuple[Tensor, dict[str, int]]:
    """Stack per-token losses; ``per_token`` returns (loss or None if rejected, clip tag)."""
    B, T = mask.shape
    rows = []
    counts = {"masked_count": 0, "clip_low_count": 0, "clip_high_count": 0, "dual_clip_count": 0}
    for b in range(B):
        row = []
        for t in range(T):
            zero = _const(0.0)
            if not bool(mask[b, t]):
                row.append(zero)
                continue
            loss, which = per_token(b, t)
            if loss is None:
                counts["masked_count"] += 1
                row.append(zero)
                continue
            if which is not None:
                counts[which] += 1
            row.append(loss)
        rows.append(torch.stack(row))
    return torch.stack(rows), counts


def reference(
    kind: str,
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    entropy: Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    **params: float | None,
) -> tuple[Tensor, dict[str, int]]:
    """Reference token loss of objective ``kind`` (the functional's name) with its ``params``."""

    def ppo(b: int, t: int) -> tuple[Tensor, str | None]:
        return ppo_token(
            logprobs[b, t], _val(proximal_logprobs[b, t]), _val(advantages[b, t]),
            clip_low, clip_high, dual_clip,
        )  # fmt: skip

    def w(b: int, t: int) -> float:
        return math.exp(_val(proximal_logprobs[b, t]) - _val(behavior_logprobs[b, t]))

    def weighted(weight: float, b: int, t: int) -> tuple[Tensor, str | None]:
        loss, which = ppo(b, t)
        return weight * loss, which

    def per_token(b: int, t: int) -> tuple[Tensor | None, str | None]:
        if kind == "ppo_clip":
            return ppo(b, t)
        if kind in ("tis", "decoupled_ppo"):
            cap = params.get("weight_cap", 2.0 if kind == "tis" else None)
            above = params.get("weight_mask_above")
            if above is not None and w(b, t) > above:
                return None, None
            return weighted(w(b, t) if cap is None else min(w(b, t), cap), b, t)
        if kind == "icepop":
            alpha, beta = params.get("alpha", 0.5), params.get("beta", 5.0)
            if not alpha <= w(b, t) <= beta:
                return None, None
            return weighted(w(b, t), b, t)
        if kind == "kpop":
            p = math.exp(_val(proximal_logprobs[b, t]))
            q = math.exp(_val(behavior_logprobs[b, t]))
            if max(binary_kl(p, q), binary_kl(q, p)) > params.get("kl_threshold", 0.1):
                return None, None
            return ppo(b, t)
        if kind == "dis":
            rho = torch.exp(logprobs[b, t] - _val(behavior_logprobs[b, t]))
            lo, hi = 1 - params.get("eps_low", 0.3), 1 + params.get("eps_high", 5.0)
            if not lo < _val(rho) < hi:
                return None, None
            return -rho * _val(advantages[b, t]), None
        if kind == "estr":
            log_w = _val(logprobs[b, t]) - _val(behavior_logprobs[b, t])
            score = log_w**2 / (max(_val(entropy[b, t]), 0.0) + params.get("eps", 1e-6))
            if score > params.get("threshold", 1.0):
                return None, None
            return ppo(b, t)
        raise ValueError(kind)

    return _loop(mask, per_token)


def binary_kl(p: float, q: float) -> float:
    """KL(Bernoulli(p) ‖ Bernoulli(q)) for p, q in (0, 1)."""
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def reference_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None
) -> tuple[Tensor, int]:
    """½ max((V − y)², (clip(V, V_old ± ε) − y)²) per action; and how many took the clipped term."""
    B, T = mask.shape
    rows, clipped_count = [], 0
    for b in range(B):
        row = []
        for t in range(T):
            if not bool(mask[b, t]):
                row.append(_const(0.0))
                continue
            v, old, y = values[b, t], _val(old_values[b, t]), _val(returns[b, t])
            error = (v - y) ** 2
            if clip is not None:
                v_clipped = min(max(v, _const(old - clip)), _const(old + clip))
                clipped_error = (v_clipped - y) ** 2
                if _val(clipped_error) > _val(error):
                    error = clipped_error
                    clipped_count += 1
            row.append(0.5 * error)
        rows.append(torch.stack(row))
    return torch.stack(rows), clipped_count
