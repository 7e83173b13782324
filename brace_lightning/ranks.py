"""Data-parallel reductions of the PPO update (DDP or FSDP2 through Lightning's strategy).

Every rank trains on its own rollouts. So that the update is the one of the concatenated batch:

- token losses are divided by the minibatch's action tokens summed over ranks (:meth:`global_count`);
- advantages are whitened with the mean and variance over all ranks' actions (:meth:`whiten`);
- every rank runs as many micro-batches as the rank with the most (:meth:`reduce_max`);
- per-minibatch statistics are summed (``*_max``: maximised) over ranks (:meth:`reduce_stats`) and the
  step's logged metrics combined (:func:`combine_rank_metrics`), so every rank logs the same values.

With one process every method is the identity (or the local value), and nothing is communicated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from brace_lightning.objectives.aggregation import counted
from brace_lightning.step_metrics import masked_mean


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x − mean) / std`` over the actions of the batch, 0 at non-actions."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return torch.where(mask, (x - mean) * torch.rsqrt(var + eps), 0.0)


class Ranks:
    """The reductions above over the ranks of ``trainer``."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.world_size = trainer.world_size
        self.strategy = trainer.strategy

    def global_count(self, mask: torch.Tensor) -> torch.Tensor:
        """Action tokens of ``mask`` summed over all ranks (at least 1), float32."""
        count = mask.sum().to(torch.float32)
        if self.world_size > 1:
            count = self.strategy.reduce(count, reduce_op="sum")
        return count.clamp(min=1.0)

    def loss_scale(self, mask: torch.Tensor, mode: str, tokens: torch.Tensor) -> torch.Tensor:
        """world_size / the global count the actor loss of ``mode`` divides by
        (``objectives/aggregation.py``): ``tokens`` (the global action count of ``mask``) for
        ``token_mean``, else the rows of all ranks (DDP averages gradients over ranks)."""
        if mode == "token_mean":
            return self.world_size / tokens
        return self.world_size / self.global_count(counted(mask, mode))

    def whiten(self, x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        """:func:`whiten` with the mean and variance over the actions of all ranks."""
        if self.world_size == 1:
            return whiten(x, mask, eps)
        count = self.global_count(mask)
        mean = self.strategy.reduce(torch.where(mask, x, 0.0).sum(), reduce_op="sum") / count
        centered = torch.where(mask, x - mean, 0.0)
        var = self.strategy.reduce((centered**2).sum(), reduce_op="sum") / count
        return centered * torch.rsqrt(var + eps)

    @property
    def reduce_max(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The maximum over ranks (None with one process: nothing to equalise)."""
        if self.world_size == 1:
            return None
        return lambda value: self.strategy.reduce(value, reduce_op="max")

    def reduce_stats(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-minibatch stats of all ranks: ``*_max`` → maximum, the rest → sum (each is this
        rank's share of a loss or count already divided by the global token count)."""
        if self.world_size == 1:
            return sums
        names = sorted(sums)
        values = torch.stack([sums[name].float().reshape(()) for name in names])
        is_max = torch.tensor([name.endswith("_max") for name in names], device=values.device)
        total = self.strategy.reduce(torch.where(is_max, 0.0, values), reduce_op="sum")
        peak = self.strategy.reduce(torch.where(is_max, values, -math.inf), reduce_op="max")
        combined = torch.where(is_max, peak, total)
        return dict(zip(names, combined.unbind(), strict=True))

    def combine_metrics(self, values: dict[str, float]) -> dict[str, float]:
        """This rank's logged ``values`` combined with every other rank's (a collective)."""
        if self.world_size == 1:
            return values
        per_rank: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(per_rank, values)
        return combine_rank_metrics(per_rank)


def combine_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One value per metric from every data-parallel rank's: ``*_max`` → maximum, ``*_min`` →
    minimum, ``data/count/*`` (sample counters) → sum, anything else → mean over the ranks that
    logged it (so a ``*_std`` is the mean of the per-rank standard deviations).

    The minibatch statistics (losses, clip fractions, ...) are already summed over ranks
    (:meth:`Ranks.reduce_stats`), so their mean is the value itself; rollout metrics such as
    ``rollout/reward`` become the mean of the per-rank means (ranks hold equally many rows).
    """
    names = sorted({name for values in per_rank for name in values})
    out: dict[str, float] = {}
    for name in names:
        values = [ranked[name] for ranked in per_rank if name in ranked]
        if name.endswith("_max"):
            out[name] = max(values)
        elif name.endswith("_min"):
            out[name] = min(values)
        elif name.startswith("data/count/"):
            out[name] = sum(values)
        else:
            out[name] = sum(values) / len(values)
    return out
