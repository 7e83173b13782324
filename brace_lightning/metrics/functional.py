"""Per-action bookkeeping shared by the metrics: action index, remaining horizon, return-to-go.

All functions follow the token conventions of ``docs/conventions.md``: ``mask[b, t]`` is True at
actions; columns between actions (tool output, prompt, padding) are skipped, so every count is in
action steps; the reward is read at action columns only. Outputs are 0 at non-action columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "action_index",
    "bin_index",
    "check_bin_edges",
    "check_mask",
    "remaining_horizon",
    "reward_to_go",
]


def check_mask(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Raise ValueError unless ``mask`` is a bool ``[B, T]`` tensor and every tensor matches it.

    Tensors given by keyword must have the mask's shape and finite values at action positions.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a torch.bool tensor (True at actions); got {what}.")
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape [B, T]; got {tuple(mask.shape)}.")
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a tensor; got {type(tensor).__name__}.")
        if tensor.shape != mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}; expected {tuple(mask.shape)} like mask."
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor[mask]).all()):
            raise ValueError(f"{name} has non-finite values at action positions; expected finite.")


def action_index(mask: torch.Tensor) -> torch.Tensor:
    """n_t: how many actions precede column t in its row (0 at the first action).

    Args:
        mask: ``[B, T]`` bool, True at actions.

    Returns:
        ``[B, T]`` long, 0 at non-actions.
    """
    check_mask(mask)
    index = mask.long().cumsum(dim=1) - 1
    return torch.where(mask, index, torch.zeros_like(index))


def remaining_horizon(mask: torch.Tensor) -> torch.Tensor:
    """h_t: actions from column t to the row's last action, both included (1 at the last action).

    Args:
        mask: ``[B, T]`` bool, True at actions.

    Returns:
        ``[B, T]`` long, 0 at non-actions.
    """
    check_mask(mask)
    remaining = mask.long().flip(1).cumsum(dim=1).flip(1)
    return torch.where(mask, remaining, torch.zeros_like(remaining))


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0) -> torch.Tensor:
    """Realized discounted return from each action, counted in action steps.

    G_t = Σ_{t' ≥ t, t' action} γ^(n_{t'} − n_t) r_{t'}; with γ = 1 and a terminal reward, G_t = R.

    Args:
        rewards: ``[B, T]`` floating point; read at actions only.
        mask: ``[B, T]`` bool, True at actions.
        gamma: discount per action step, in [0, 1].

    Returns:
        ``[B, T]`` in the rewards' dtype, 0 at non-actions.
    """
    check_mask(mask, rewards=rewards)
    if not isinstance(gamma, int | float) or not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be a number in [0, 1]; got {gamma!r}.")
    masked = torch.where(mask, rewards, torch.zeros_like(rewards))
    if gamma == 1.0:
        out = masked.flip(1).cumsum(dim=1).flip(1)
    else:
        # γ^(−n) scaling overflows on long rows, so run the recurrence; holes carry G unchanged.
        out = torch.zeros_like(masked)
        carry = torch.zeros_like(masked[:, 0])
        for t in range(masked.shape[1] - 1, -1, -1):
            carry = torch.where(mask[:, t], masked[:, t] + gamma * carry, carry)
            out[:, t] = carry
    return torch.where(mask, out, torch.zeros_like(out))


def check_bin_edges(name: str, edges: Sequence[int]) -> torch.Tensor:
    """Validate integer bin edges (non-negative, strictly increasing) and return them as a tensor."""
    values = list(edges)
    if not values or any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in values):
        raise ValueError(f"{name} must be a non-empty sequence of ints >= 0; got {edges!r}.")
    if any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"{name} must be strictly increasing; got {edges!r}.")
    return torch.tensor(values, dtype=torch.long)


def bin_index(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Bin i holds e_i ≤ x < e_{i+1}; the last bin is open-ended; −1 for x < e_0.

    Args:
        x: long tensor of any shape.
        edges: ``[num_bins]`` long, strictly increasing left edges.

    Returns:
        long tensor shaped like ``x``.
    """
    return torch.bucketize(x, edges.to(x.device), right=True) - 1
