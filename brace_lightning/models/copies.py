"""Copies of the actor that the PPO update reads but never trains: the KL reference and PPO-EWMA.

- :class:`ReferencePolicy` — the frozen π_ref of the KL term (``kl_coef`` > 0): the actor's
  weights as RL training starts (after any warm start), copied once by :meth:`~ReferencePolicy.capture`
  and afterwards changed only by checkpoint loading. Always in eval mode (no dropout in log π_ref).
- :class:`EwmaPolicy` — π_prox of PPO-EWMA (Hilton et al. 2021): a bias-corrected exponential
  moving average of the actor's weights, updated after every actor optimizer step.

Both are ``nn.Module``s of the LightningModule, so Lightning moves them, FSDP2 shards the reference
like the actor and checkpoints carry them (keys ``reference.policy.*``; ``ewma.policy.*``,
``ewma.sums.*``, ``ewma.steps``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from brace_lightning.models.parallelize import WRAPPER_PREFIX

#: State-dict key prefixes written before the copies became modules of their own -> today's.
LEGACY_PREFIXES = {
    "reference_actor.": "reference.policy.",
    "ewma_actor.": "ewma.policy.",
    "_ewma_sums.": "ewma.sums.",
    "ewma_steps": "ewma.steps",
}


def upgrade_checkpoint_keys(checkpoint: dict[str, Any]) -> None:
    """Rename the copies' keys of a checkpoint written with the old names (``reference_actor.*``,
    ``ewma_actor.*``, ``_ewma_sums.*``, ``ewma_steps``), so it resumes. Single-file checkpoints
    only: Lightning reads a sharded (FSDP2) checkpoint by the module's keys before any hook."""
    weights = checkpoint.get("state_dict", {})
    for key in list(weights):
        for old, new in LEGACY_PREFIXES.items():
            if key.startswith(old):
                weights[new + key.removeprefix(old)] = weights.pop(key)
                break


class ReferencePolicy(nn.Module):
    """The frozen reference policy π_ref of the KL term.

    Args:
        actor: the actor to copy the architecture (and, for now, the weights) of.
    """

    #: State-dict prefix of the reference's weights inside the LightningModule.
    PREFIX = "reference.policy."

    def __init__(self, actor: nn.Module) -> None:
        super().__init__()
        self.policy = copy.deepcopy(actor).requires_grad_(False).eval()
        self.captured = False

    def train(self, mode: bool = True) -> ReferencePolicy:
        """Stay in eval mode whatever the LightningModule asks (no dropout in its log-probs)."""
        return super().train(False)

    @torch.no_grad()
    def capture(self, actor: nn.Module) -> None:
        """Copy ``actor``'s weights, once per run: called before any forward of the first training
        step, so under FSDP2 both models hold only their shards, placed alike, and the copy is
        shard to shard (activation-checkpoint wrappers' key prefix ignored)."""
        sources = {
            name.replace(WRAPPER_PREFIX, ""): tensor
            for named in (actor.named_parameters(), actor.named_buffers())
            for name, tensor in named
        }
        for named in (self.policy.named_parameters(), self.policy.named_buffers()):
            for name, tensor in named:
                tensor.copy_(sources[name])
        self.captured = True

    def load_checkpoint_state(self, checkpoint: dict[str, Any], kl_coef: float) -> None:
        """Keep the checkpointed run's reference (its weights are in the state dict): a checkpoint
        saved without one (``kl_coef`` = 0) has lost its initial policy, and capturing the resumed
        actor instead would silently change what the KL is measured against."""
        state = checkpoint["brace"]
        if "reference_captured" not in state:
            raise ValueError(
                f"kl_coef={kl_coef} needs a checkpoint that holds the reference policy; got "
                "one saved with kl_coef=0 (resume it with kl_coef=0, or start a new run)."
            )
        self.captured = bool(state["reference_captured"])

    @classmethod
    def drop_from_checkpoint(cls, checkpoint: dict[str, Any]) -> None:
        """Remove a saved reference from ``checkpoint``'s state dict, so that a run can resume with
        the KL term off. (Under FSDP2 Lightning loads the sharded state dict before the hooks, by
        the module's keys: a saved reference is then simply not read.)"""
        weights = checkpoint.get("state_dict", {})
        for key in [key for key in weights if key.startswith(cls.PREFIX)]:
            del weights[key]


class EwmaPolicy(nn.Module):
    """π_prox of PPO-EWMA: ``policy`` holds Σ decayⁱ·(1 − decay)·θ_{n−i} / (1 − decayⁿ) after n
    actor steps (the bias-corrected average of the actor's weights).

    Args:
        actor: the actor whose weights are averaged.
        decay: the EWMA decay in (0, 1) (``actor_objective.ewma_decay``).
    """

    def __init__(self, actor: nn.Module, decay: float) -> None:
        super().__init__()
        self.decay = float(decay)
        self.policy = copy.deepcopy(actor).requires_grad_(False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.sums = nn.ParameterList(
            nn.Parameter(torch.zeros_like(p), requires_grad=False) for p in actor.parameters()
        )

    @property
    def ready(self) -> bool:
        """Whether the average holds any weights (before the first actor step it holds the copy
        made at construction, from before any warm start, so π_prox is the actor itself)."""
        return int(self.steps) > 0

    @torch.no_grad()
    def update(self, actor: nn.Module) -> None:
        """Fold ``actor``'s current weights into the average."""
        self.steps += 1
        correction = 1.0 - self.decay ** int(self.steps)
        for total, param, ewma in zip(
            self.sums, actor.parameters(), self.policy.parameters(), strict=True
        ):
            total.mul_(self.decay).add_(param.detach(), alpha=1.0 - self.decay)
            ewma.copy_(total / correction)
