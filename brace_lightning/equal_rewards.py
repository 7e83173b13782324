"""Rollout batches and prompt groups whose rewards are all equal: no policy gradient from them.

Once a run has collapsed every reward is 0 (and once a task is solved, every reward is 1). The
advantages of such a batch are then only critic noise (return − V with no reward signal), and
whitening turns that noise into unit-variance advantages; AdamW, which normalises the gradient's
scale, turns those into full-size actor steps that keep a collapsed run from recovering (issue 30).
Two rules, both reading the sequence rewards ``batch.scores`` ``[B]``:

- **batch rule** (``BraceModule(skip_equal_reward_batches=True)``, on by default): when every score
  of the rollout batch, over all data-parallel ranks, is the same number, the actor takes no
  optimizer step (no scheduler step, no EWMA update, no new policy version published). The critic
  still trains on the batch: its targets (returns against V) hold information whatever the rewards.
  Logged: ``actor/skipped_equal_reward`` (1 on a skipped step, else 0) and
  ``actor/skipped_equal_reward_total`` (skipped steps so far: the steps past the critic warm-up
  that published no policy version, so a resumed run counts on from its checkpoint).
- **group rule** (``mask_equal_reward_groups=True``, off by default): DAPO's dynamic-sampling rule
  (Yu et al. 2025, §3.2) as a mask: the actions of a prompt group (rows sharing ``batch.group_ids``)
  whose scores are all equal get advantage 0 and are left out of the whitening statistics, so they
  give no policy-gradient term. They stay in the loss's token count (one normalisation for every
  token, ``objectives/base.py``) and a KL-to-reference loss term still applies to them. With a
  critic such a group still carries signal (its return against V), so whether the rule helps a
  critic-based target is an open question; it is an option, not a default.

``rollout/equal_reward_group_fraction`` (logged every step, whatever the options) is the fraction of
prompt groups of two or more rows whose scores are all equal: 1.0 for a collapsed (or saturated)
batch, the signal :class:`brace_lightning.callbacks.CollapseWarning` watches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from brace_lightning.checks import require_bool
from brace_lightning.rollout.types import RolloutBatch


def rewards_all_equal(
    scores: torch.Tensor, reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> bool:
    """Whether every entry of ``scores`` ``[B]`` (B ≥ 1) is the same number, over all ranks.

    ``reduce_max`` takes the elementwise maximum of a tensor over the data-parallel ranks (None with
    one process); the batch's minimum and maximum travel in one collective.
    """
    scores = scores.detach().float()
    extremes = torch.stack([scores.max(), -scores.min()])
    if reduce_max is not None:
        extremes = reduce_max(extremes)
    return bool(extremes[0] == -extremes[1])


def equal_reward_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: True at rows whose prompt group (rows sharing ``group_ids`` ``[B]``) has all
    scores ``[B]`` equal. A group of one row counts as equal (it has no spread to learn from)."""
    _, group = torch.unique(group_ids, return_inverse=True)
    scores = scores.detach().float()
    size = len(group_ids)
    group_max = torch.full((size,), -torch.inf, dtype=scores.dtype, device=scores.device)
    group_min = torch.full((size,), torch.inf, dtype=scores.dtype, device=scores.device)
    group_max = group_max.scatter_reduce(0, group, scores, reduce="amax")
    group_min = group_min.scatter_reduce(0, group, scores, reduce="amin")
    return (group_max == group_min)[group]


def equal_reward_group_fraction(scores: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of the prompt groups with two or more rows whose scores are all equal (NaN when no
    group has two rows: a group of one says nothing about the reward's spread)."""
    _, group, sizes = torch.unique(group_ids, return_inverse=True, return_counts=True)
    equal = torch.zeros(len(sizes), dtype=torch.bool, device=scores.device)
    equal = equal.scatter(0, group, equal_reward_groups(scores, group_ids))
    groups = sizes >= 2
    if not bool(groups.any()):
        return float("nan")
    return float(equal[groups].float().mean())


class EqualRewards:
    """The batch and group rules of the module docstring, and the batch rule's count.

    Args:
        skip_batches: the batch rule (``BraceModule``'s ``skip_equal_reward_batches``).
        mask_groups: the group rule (``BraceModule``'s ``mask_equal_reward_groups``).
    """

    def __init__(self, skip_batches: bool, mask_groups: bool) -> None:
        require_bool("skip_equal_reward_batches", skip_batches)
        require_bool("mask_equal_reward_groups", mask_groups)
        self.skip_batches = skip_batches
        self.mask_groups = mask_groups
        self.skipped = False  # this rollout step

    def actor_steps(
        self,
        due: bool,
        scores: torch.Tensor,
        reduce_max: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> bool:
        """Whether the actor steps on this batch: ``due`` (the critic warm-up is over) and, with the
        batch rule, not every score ``[B]`` equal over all ranks (:attr:`skipped` says which)."""
        self.skipped = due and self.skip_batches and rewards_all_equal(scores, reduce_max)
        return due and not self.skipped

    def policy_advantages(
        self, advantages: torch.Tensor, batch: RolloutBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantages, actions)``, both ``[B, T]``: the actor's advantages and the actions they
        are whitened over. Without the group rule ``advantages`` and ``batch.mask`` themselves; with
        it, the actions of equal-reward groups are taken out of the mask, their advantages set to 0."""
        if not self.mask_groups:
            return advantages, batch.mask
        actions = batch.mask & ~equal_reward_groups(batch.scores, batch.group_ids)[:, None]
        return torch.where(actions, advantages, 0.0), actions
