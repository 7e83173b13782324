"""A backbone with a value head as the reward model: the critic folder ``brace-lightning export``
writes (``DIR/critic``: a Hugging Face backbone, ``value_head.safetensors`` and the tokenizer).

:class:`CriticReward` is :class:`~brace_lightning.tasks.RewardModel` with the critic in place of a
sequence-classification model: a pair's reward is the critic's value V of the whole pair (the
value at its last token), read with :func:`~brace_lightning.export.load_exported_critic`, so a
critic trained by this project, or any backbone saved with a value head in that layout, scores
completions. It lives here, above ``tasks/``, because the critic's loader belongs to the models.
"""

from __future__ import annotations

from typing import Any

import torch

from brace_lightning.export import load_exported_critic
from brace_lightning.tasks.reward_model import RewardModel


class CriticReward(RewardModel):
    """The value of prompt + completion under an exported critic (module docstring).

    Args:
        model: the critic folder (``DIR/critic`` of ``brace-lightning export``).
        tokenizer, device, batch_size, max_length, threshold, template, chat_template: as in
            :class:`~brace_lightning.tasks.RewardModel`.
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        device: str = "cpu",
        batch_size: int = 16,
        max_length: int = 1024,
        threshold: float = 0.0,
        template: str = "{prompt}{completion}",
        chat_template: bool | None = None,
    ) -> None:
        super().__init__(
            model,
            tokenizer=tokenizer,
            device=device,
            batch_size=batch_size,
            max_length=max_length,
            threshold=threshold,
            template=template,
            chat_template=chat_template,
        )

    def _load_model(self, tokenizer: Any) -> torch.nn.Module:
        return load_exported_critic(self.model_name)

    def _rewards(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[b]``: the value at each right-padded row's last real token."""
        values = self._model(input_ids, attention_mask)  # [b, T]
        last = attention_mask.long().sum(1) - 1
        return values[torch.arange(len(values), device=values.device), last]
