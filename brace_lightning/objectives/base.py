"""Base types of the actor objectives.

Every actor objective maps per-token log-probs and advantages to a per-token loss ``[B, T]`` that is
0 at non-actions. The LightningModule sums it and divides by one global count of action tokens per
optimizer step (masked-out tokens stay in that count), so gradient accumulation and data
parallelism give the same gradient as one big batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ObjectiveOutput(NamedTuple):
    """``token_loss`` ``[B, T]`` (0 at non-actions, to be summed and divided by the global
    action-token count) and ``stats``: detached scalar tensors for logging, over this micro-batch's
    actions. ``*_count`` are token counts and ``*_sum`` sums (the module divides both by the action
    count to log fractions and means); ``*_max`` are maxima (reduce with max, 0 if no actions)."""

    token_loss: torch.Tensor
    stats: dict[str, torch.Tensor]


class ActorObjective:
    """Base class of the actor-side objectives (selected by LightningCLI ``class_path``).

    Subclasses carry hyperparameters, validate them in ``__init__`` and call one pure function of
    :mod:`brace_lightning.objectives.functional` in ``__call__``.

    Attributes:
        needs_entropy: the objective reads the engine's per-token entropy (ESTR).
        ewma_decay: if not None, the module keeps an EWMA copy of the actor's weights with this
            decay and passes its log-probs as ``proximal_logprobs`` (PPO-EWMA).
    """

    needs_entropy: bool = False
    ewma_decay: float | None = None

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
        """Args (all ``[B, T]``):
        logprobs: log π_θ of the taken tokens (differentiable).
        proximal_logprobs: log π_prox, the trainer's policy at the start of the step (no grad).
        behavior_logprobs: log µ recorded by the engine.
        advantages: Â from the value target (already whitened by the module).
        mask: bool, True at actions.
        entropy: engine's per-token entropy H_µ (only objectives with ``needs_entropy``).
        """
        raise NotImplementedError
