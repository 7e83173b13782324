"""Sample and batch types shared by engines, the data module and the LightningModule.

Layout of one row (``[T]`` = prompt + response, see ``docs/conventions.md``)::

    input_ids:  [pad pad p0 p1 p2 | a0 a1 obs obs a2 a3 | pad pad]
    mask:       [ F   F  F  F  F  |  T  T  F   F   T  T |  F   F ]

Prompts are left-padded, responses right-padded, so every row's response starts at the same column.
``mask`` is True at **actions** (tokens the policy generated). The log-prob of the token at column
t comes from the logits at column t − 1, and the critic's value of the state *before* action t is
read at column t − 1 as well (the module does that shift; batches store per-token quantities at the
token's own column).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


@dataclass
class RolloutBatch:
    """A batch of finished rollouts, all tensors ``[B, T]`` unless noted.

    Args:
        input_ids: token ids, long.
        attention_mask: True at real tokens (prompt, response, observations), False at padding.
        mask: True at actions (policy-generated tokens); False at prompt, padding, observations.
        behavior_logprobs: log µ(token) recorded by the engine at sampling time, 0 at non-actions.
        versions: policy version that sampled each action token, -1 at non-actions (long).
        rewards: per-token reward; the verifier's reward sits on the last action token of the row.
        scores: ``[B]`` sequence-level reward (the verifier's output, before any shaping).
        group_ids: ``[B]`` long, rows generated from the same prompt share an id.
        entropy: entropy of the engine's sampling distribution at each action, 0 elsewhere, or None.
        correct: ``[B]`` bool, whether the verifier judged the answer correct (for accuracy logging).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    versions: torch.Tensor
    rewards: torch.Tensor
    scores: torch.Tensor
    group_ids: torch.Tensor
    entropy: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    info: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        for name in ("attention_mask", "mask", "behavior_logprobs", "versions", "rewards"):
            value = getattr(self, name)
            if value.shape != shape:
                raise ValueError(
                    f"RolloutBatch.{name} has shape {tuple(value.shape)}; expected {tuple(shape)} "
                    "like input_ids."
                )
        if self.mask.dtype != torch.bool:
            raise ValueError(f"RolloutBatch.mask has dtype {self.mask.dtype}; expected torch.bool.")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn) -> RolloutBatch:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = fn(value) if isinstance(value, torch.Tensor) else value
        return replace(self, **out)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """Move every tensor to ``device``."""
        return self._map(lambda t: t.to(device))

    def select(self, index: torch.Tensor) -> RolloutBatch:
        """Rows ``index`` (a long or bool tensor over the batch dimension)."""
        return self._map(lambda t: t[index])

    def min_versions(self) -> torch.Tensor:
        """``[B]`` oldest policy version among each row's actions (-1 for rows with no action)."""
        if self.versions.shape[1] == 0:
            return torch.full((len(self),), -1, dtype=torch.long, device=self.versions.device)
        big = torch.iinfo(self.versions.dtype).max
        v = torch.where(self.mask, self.versions, torch.full_like(self.versions, big)).amin(dim=1)
        return torch.where(self.mask.any(dim=1), v, torch.full_like(v, -1))

    @property
    def num_actions(self) -> int:
        return int(self.mask.sum())

    def require_actions(self, rollout_step: int) -> None:
        """Raise RuntimeError, with the producer's ``count/*`` info, if the batch has no action
        tokens (nothing to train on: every row dropped, or every response empty)."""
        if len(self) == 0 or self.num_actions == 0:
            counts = {k: v for k, v in self.info.items() if k.startswith("count/")}
            raise RuntimeError(
                f"rollout step {rollout_step}: the rollout batch has no action tokens "
                f"(counts: {counts}); check the task, the reward function and max_staleness."
            )
