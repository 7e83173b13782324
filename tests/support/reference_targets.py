"""Slow float64 references for the value-target kernels, written as plainly as the definitions.

Each row's actions are listed, then every target is a literal double loop over (s, t). No packing,
no scan, no telescoping: the BRACE tail is summed residual by residual.
"""

from __future__ import annotations

import math

import torch


def reference_targets(
    kind: str,
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    target_logprobs: torch.Tensor | None = None,
    behavior_logprobs: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    lmbda: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    k: int | None = None,
    mc_tail: bool = True,
    log_budget: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) in float64 for ``kind`` in {"gae", "vtrace", "brace"}."""
    B, T = mask.shape
    advantages = torch.zeros(B, T, dtype=torch.float64)
    returns = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        cols = [t for t in range(T) if bool(mask[b, t])]
        n = len(cols)
        r = [float(rewards[b, t]) for t in cols]
        V = [float(values[b, t]) for t in cols] + [0.0]  # value after the last action is 0
        if kind == "gae":
            w = [1.0] * n
        else:
            w = [
                math.exp(float(target_logprobs[b, t]) - float(behavior_logprobs[b, t]))
                for t in cols
            ]
        rho = [min(rho_bar, x) for x in w]
        c = [lmbda * min(c_bar, x) for x in w]
        delta = [r[t] + gamma * V[t + 1] - V[t] for t in range(n)]

        v = [0.0] * (n + 1)
        adv = [0.0] * n
        for s in range(n):
            if kind == "gae":
                adv[s] = sum((gamma * lmbda) ** (t - s) * delta[t] for t in range(s, n))
                v[s] = adv[s] + V[s]
                continue
            j = n if (kind == "vtrace" or k is None) else min(s + k, n)
            if kind == "brace" and log_budget is not None:
                # The window stops before the first step whose product leaves exp(±budget).
                size, log_product = 0, 0.0
                while s + size < j:
                    factor = c[s + size]
                    log_product += math.log(factor) if factor > 0 else -math.inf
                    if abs(log_product) > log_budget:
                        break
                    size += 1
                j = s + size
            total = V[s]
            product = 1.0  # Π_{i=s}^{t-1} c_i
            for t in range(s, j):
                total += gamma ** (t - s) * product * rho[t] * delta[t]
                product *= c[t]
            for t in range(j, n):  # product is now Π_k(s)
                u = 1.0 if mc_tail else rho[t]
                total += product * gamma ** (t - s) * u * delta[t]
            v[s] = total
        if kind != "gae":
            for s in range(n):
                adv[s] = r[s] + gamma * v[s + 1] - V[s]
                if kind == "vtrace":
                    adv[s] *= rho[s]
        for s, col in enumerate(cols):
            advantages[b, col] = adv[s]
            returns[b, col] = v[s]
    return advantages, returns
