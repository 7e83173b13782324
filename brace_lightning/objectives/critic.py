"""Config class of the critic loss (:func:`.functional.clipped_value_loss`)."""

from __future__ import annotations

import torch

from brace_lightning.objectives import functional as F
from brace_lightning.objectives.actor import _positive
from brace_lightning.objectives.base import ObjectiveOutput


class CriticLoss:
    """Clipped value loss ½·max((V − y)², (clip(V, V_old ± ε) − y)²), 0 at non-actions.

    The LightningModule sums ``token_loss`` and divides by the global action-token count, like the
    actor loss.

    Args:
        clip: ε, how far V may move from V_old before the clipped error takes over (0.5 in the
            BRACE paper). Positive, or None for the plain ½ (V − y)².
    """

    def __init__(self, *, clip: float | None = 0.5) -> None:
        _positive("clip", clip, optional=True)
        self.clip = clip

    def __call__(
        self,
        *,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
    ) -> ObjectiveOutput:
        """Args (all ``[B, T]``): values V (differentiable), old_values V_old (the critic's values
        when the targets were computed), returns y (the value target), mask (bool, True at
        actions)."""
        return F.clipped_value_loss(values, old_values, returns, mask, clip=self.clip)

    def __repr__(self) -> str:
        return f"CriticLoss(clip={self.clip!r})"
