"""Slow, obviously correct float64 references of the group-relative advantages and aggregation.

One Python loop over groups and rows, written from the formulas of ``targets/groups.py`` and
``objectives/aggregation.py`` (and TRL 1.16's conventions: unbiased std, eps added to the std).
"""

from __future__ import annotations

import math

import torch


def reference_group_advantages(
    rewards: list[float],
    group_ids: list[int],
    estimator: str,
    eps: float,
    weights: list[float] | None = None,
) -> list[float]:
    """One advantage per row, by a plain loop over each row's group."""
    w = [1.0] * len(rewards) if weights is None else list(weights)
    out = []
    for i, (r, g) in enumerate(zip(rewards, group_ids, strict=True)):
        members = [j for j, h in enumerate(group_ids) if h == g]
        n = len(members)
        if n == 1:
            out.append(0.0)
            continue
        if estimator == "RLOO":
            others = [j for j in members if j != i]
            total = sum(w[j] for j in others)
            baseline = sum(w[j] * rewards[j] for j in others) / total
            out.append(r - baseline)
            continue
        baseline = sum(w[j] * rewards[j] for j in members) / sum(w[j] for j in members)
        if estimator == "DrGRPO":
            out.append(r - baseline)
            continue
        mean = sum(rewards[j] for j in members) / n
        std = math.sqrt(sum((rewards[j] - mean) ** 2 for j in members) / (n - 1))
        out.append((r - baseline) / (std + eps))
    return out


def reference_sequence_weights(
    target: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, rho_bar: float
) -> list[float]:
    """min(ρ̄, Π_t π/µ) per row, unscaled (float64 loop over actions)."""
    out = []
    for b in range(target.shape[0]):
        ratio = 1.0
        for t in range(target.shape[1]):
            if mask[b, t]:
                ratio *= math.exp(float(target[b, t]) - float(behavior[b, t]))
        out.append(min(rho_bar, ratio))
    return out


def reference_aggregate(
    token_loss: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int | None
) -> float:
    """The aggregation formulas, by a loop over rows and tokens."""
    rows = token_loss.shape[0]
    if mode == "token_mean":
        total = sum(
            float(token_loss[b, t]) for b in range(rows) for t in range(mask.shape[1]) if mask[b, t]
        )
        return total / max(1, int(mask.sum()))
    per_row = []
    for b in range(rows):
        s = sum(float(token_loss[b, t]) for t in range(mask.shape[1]) if mask[b, t])
        n = int(mask[b].sum())
        per_row.append(s / (max_len or 1) if mode == "seq_mean_token_sum" else s / max(n, 1))
    return sum(per_row) / rows
