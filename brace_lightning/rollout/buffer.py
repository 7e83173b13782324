"""The staleness buffer: finished rollout batches waiting for the trainer, admission and the check.

Rollout batches are numbered in the order the trainer consumes them: batch ``n`` feeds rollout step
``n``. With ``max_staleness = S`` (docs/conventions.md, "Versions and staleness"):

- **admission** (AReaL's capacity rule, with the trainer's batch as the unit): batch ``n`` may be
  started only after ``n − S`` rollout steps are complete and the weights they published reached the
  producer, so at most ``S + 1`` batches are ever generated ahead of the trainer. A batch started
  with version ``v(n − S)`` and consumed at step ``n`` then has staleness ``v(n) − v(n − S) ≤ S``
  because a step raises the version by at most one;
- **the consume-time check** (:func:`split_stale`), applied whatever admission promised: a row whose
  oldest action token is more than ``S`` versions older than the trainer is dropped and counted, and
  so is a row without actions.

Rows are dropped one by one, so a prompt group (the ``samples_per_prompt`` rows sharing a
``group_ids`` entry) may lose some of its rows here (or earlier, to a reward timeout). The rule for
such a **partial group**: its survivors stay, and the group-relative targets compute their baseline
over the survivors only (a survivor left alone gets advantage 0, ``targets/groups.py``); the data
modules log how many groups of a batch are partial as ``data/partial_groups``
(:func:`partial_groups`, logged when not 0).

:func:`batch_to_state` / :func:`batch_from_state` turn a batch into plain tensors and numbers (what
crosses a process boundary and what a checkpoint loaded with ``torch.load(weights_only=True)``
accepts). Nothing here starts processes or imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from brace_lightning.rollout.types import RolloutBatch


def batch_to_state(batch: RolloutBatch) -> dict[str, Any]:
    """The batch as a dict of tensors (None for absent optional fields) plus ``info`` (floats)."""
    state: dict[str, Any] = {f.name: getattr(batch, f.name) for f in fields(batch)}
    state["info"] = {name: float(value) for name, value in batch.info.items()}
    return state


def batch_from_state(state: dict[str, Any]) -> RolloutBatch:
    """Inverse of :func:`batch_to_state`."""
    return RolloutBatch(**{**state, "info": dict(state["info"])})


@dataclass
class ConsumeReport:
    """What the consume-time check did to one batch.

    Args:
        staleness: ``[B_kept]`` long, ``trainer_version − min(token versions)`` of each kept row.
        dropped_stale: rows with staleness above ``max_staleness``.
        dropped_empty: rows without any action token.
    """

    staleness: torch.Tensor
    dropped_stale: int
    dropped_empty: int


def split_stale(
    batch: RolloutBatch, trainer_version: int, max_staleness: int | None
) -> tuple[RolloutBatch, ConsumeReport]:
    """Drop the rows of ``batch`` that must not be trained on at ``trainer_version``.

    A row is dropped when it has no action (``dropped_empty``) or when
    ``trainer_version − min(its token versions) > max_staleness`` (``dropped_stale``; None = no
    bound). Returns the kept rows (same order) and the report.
    """
    staleness = trainer_version - batch.min_versions()  # [B]
    keep = batch.mask.any(dim=1)
    dropped_empty = int((~keep).sum())
    stale = torch.zeros_like(keep)
    if max_staleness is not None:
        stale = keep & (staleness > max_staleness)
        keep &= ~stale
    kept = batch if bool(keep.all()) else batch.select(keep)
    return kept, ConsumeReport(staleness[keep], int(stale.sum()), dropped_empty)


def partial_groups(group_ids: torch.Tensor, group_size: int) -> int:
    """Groups of ``group_ids`` ``[B]`` with fewer than ``group_size`` rows (they lost some)."""
    _, sizes = torch.unique(group_ids, return_counts=True)
    return int((sizes < group_size).sum())


class StalenessBuffer:
    """Finished batches keyed by their index, waiting to be consumed in index order.

    Args:
        max_staleness: S, the bound on ``trainer_version − min(token versions)`` at consumption.
    """

    def __init__(self, max_staleness: int) -> None:
        if (
            isinstance(max_staleness, bool)
            or not isinstance(max_staleness, int)
            or max_staleness < 0
        ):
            raise ValueError(f"max_staleness must be an integer >= 0; got {max_staleness!r}.")
        self.max_staleness = max_staleness
        self._batches: dict[int, RolloutBatch] = {}

    def admissible(self, completed_steps: int) -> int:
        """How many batches (indices ``0 … k − 1``) may have been started once ``completed_steps``
        rollout steps are complete: ``completed_steps + S + 1``."""
        return completed_steps + self.max_staleness + 1

    def put(self, index: int, batch: RolloutBatch) -> None:
        """Store the finished batch ``index``."""
        assert index not in self._batches, f"rollout batch {index} arrived twice"
        self._batches[index] = batch

    def __contains__(self, index: object) -> bool:
        return index in self._batches

    @property
    def num_batches(self) -> int:
        """Finished batches waiting to be consumed."""
        return len(self._batches)

    @property
    def num_samples(self) -> int:
        """Rows of the waiting batches (the ``buffered`` term of the conservation law)."""
        return sum(len(b) for b in self._batches.values())

    def pop(self, index: int, trainer_version: int) -> tuple[RolloutBatch, ConsumeReport]:
        """Remove batch ``index`` and apply the consume-time check (:func:`split_stale`)."""
        batch = self._batches.pop(index)
        return split_stale(batch, trainer_version, self.max_staleness)

    def state_dict(self) -> dict[str, Any]:
        """The waiting batches as plain tensors (``weights_only``-loadable)."""
        return {"batches": {i: batch_to_state(b) for i, b in sorted(self._batches.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (replaces the current content)."""
        self._batches = {int(i): batch_from_state(s) for i, s in state["batches"].items()}
