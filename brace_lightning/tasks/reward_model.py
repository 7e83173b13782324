"""A learned reward: a Hugging Face sequence-classification model scores each prompt + completion.

:class:`RewardModel` is a :class:`~brace_lightning.tasks.base.BatchedReward`: a rollout batch is
scored in forwards of ``batch_size`` completions, on ``device``, with gradients off. The model is
loaded on the first call, in the process that scores: in the async recipe that is the producer
process, to which only the arguments (a path or hub name, the device) are sent, never the weights
(a pickled reward carries its arguments alone), so a reward model works with ``producer:
process`` as with the synchronous data module. Validation rollouts are scored in the trainer's
process, which loads its own copy.

Each pair is rendered as the chat ``[user: prompt, assistant: completion]`` when the reward
model's tokenizer has a chat template (``chat_template: false`` turns it off), else as
``template.format(prompt=..., completion=...)``; the reward is logit ``label`` of the model's
head (a one-label head: its only output), over the pair truncated to ``max_length`` tokens from
the left, so the end of the completion is always seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from brace_lightning.tasks.base import BatchedReward, Prompt


class RewardModel(BatchedReward):
    """Scores completions with an ``AutoModelForSequenceClassification`` (module docstring).

    Args:
        model: a local folder or hub name of a sequence-classification model (e.g. a reward
            model trained on preference pairs, ``num_labels=1``).
        tokenizer: its tokenizer's folder or hub name (None: ``model``'s).
        device: where the model runs in the scoring process (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        batch_size: completions per forward.
        max_length: tokens kept per pair (the first ones are cut).
        label: the logit used as the reward.
        threshold: a completion whose reward exceeds it counts as correct (``rollout/accuracy``).
        template: format string with ``{prompt}`` and ``{completion}`` fields, used without a chat
            template.
        chat_template: None renders with the tokenizer's chat template when it has one; False
            never does.
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        device: str = "cpu",
        batch_size: int = 16,
        max_length: int = 1024,
        label: int = 0,
        threshold: float = 0.0,
        template: str = "{prompt}{completion}",
        chat_template: bool | None = None,
    ) -> None:
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RewardModel got {name}={value!r}; expected an integer >= 1.")
        if isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ValueError(f"RewardModel got label={label!r}; expected an integer >= 0.")
        if "{prompt}" not in template or "{completion}" not in template:
            raise ValueError(
                f"RewardModel got template={template!r}; expected a '{{prompt}}' and a "
                "'{completion}' field."
            )
        torch.device(device)  # a malformed device fails here, not in the producer
        self.model_name = model
        self.tokenizer_name = tokenizer or model
        self.device = device
        self.batch_size = batch_size
        self.max_length = max_length
        self.label = label
        self.threshold = float(threshold)
        self.template = template
        self.chat_template = chat_template
        self._model: Any = None
        self._tokenizer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        """The arguments only: a spawned producer loads its own model (module docstring)."""
        return {**self.__dict__, "_model": None, "_tokenizer": None}

    def _load(self) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
        self._model = self._load_model(tokenizer).to(self.device).eval()
        self._tokenizer = tokenizer

    def _load_model(self, tokenizer: Any) -> torch.nn.Module:
        """The sequence-classification model (``label`` checked against its head)."""
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(self.model_name)
        if self.label >= model.config.num_labels:
            raise ValueError(
                f"RewardModel got label={self.label}; expected an index below the model's "
                f"num_labels={model.config.num_labels} ({self.model_name!r})."
            )
        if model.config.pad_token_id is None:  # the head reads the last token that is not padding
            model.config.pad_token_id = tokenizer.pad_token_id
        return model

    def _rewards(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[b]`` rewards of right-padded pairs ``[b, T]``: logit ``label``."""
        logits = self._model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits[:, self.label]  # logits: [b, num_labels]

    def render(self, prompt: Prompt, completion: str) -> str:
        """The text the reward model reads for one pair (module docstring)."""
        tokenizer = self._tokenizer
        if self.chat_template is not False and getattr(tokenizer, "chat_template", None):
            messages = [
                {"role": "user", "content": prompt.text},
                {"role": "assistant", "content": completion},
            ]
            return tokenizer.apply_chat_template(messages, tokenize=False)
        return self.template.format(prompt=prompt.text, completion=completion)

    @torch.no_grad()
    def score_batch(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        """Logit ``label`` of each pair, in forwards of ``batch_size`` pairs."""
        if self._model is None:
            self._load()
        texts = [self.render(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            encoded = self._tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            rewards = self._rewards(encoded["input_ids"], encoded["attention_mask"])
            scores += rewards.float().cpu().tolist()
        return scores

    def correct(self, score: float) -> bool:
        """Whether ``score`` exceeds ``threshold``."""
        return score > self.threshold
