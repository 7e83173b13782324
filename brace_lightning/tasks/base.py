"""Prompts, prompt sources and reward functions: the task interface.

A task is a :class:`PromptSource` (where prompts come from) and a :class:`RewardFunction` (how a
completion is scored). Both are plain classes with typed ``__init__`` arguments so that a YAML recipe
can select a user's own subclass with ``class_path``::

    reward_fn:
      class_path: my_package.rewards.ExactMatch
      init_args: {case_sensitive: false}

Reward functions see the decoded completion text (special tokens removed) and the :class:`Prompt`
it answers; they return a float and never see token ids, so the same function serves every engine.

:func:`encode_prompt` turns a :class:`Prompt` into the token ids every engine samples from (and the
supervised warm start trains on), so a prompt is encoded the same way everywhere.
"""

from __future__ import annotations

import copy
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from brace_lightning.tasks.split import MAX_REDRAWS, check_split, in_split

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


#: The project folders of the run's ``--config`` files (``cli.py`` fills it: for each recipe, the
#: nearest folder above it that holds a ``pyproject.toml`` or ``.git``). A relative data path that a
#: recipe names and the working directory lacks is looked up there (:func:`resolve_data_path`).
RECIPE_ROOTS: list[Path] = []


def project_root(config_file: str | os.PathLike) -> Path | None:
    """The nearest folder above ``config_file`` holding a ``pyproject.toml`` or ``.git``; None if
    there is none (a recipe outside any project)."""
    for folder in Path(config_file).resolve().parents:
        if (folder / "pyproject.toml").is_file() or (folder / ".git").exists():
            return folder
    return None


def resolve_data_path(path: str | os.PathLike) -> Path:
    """``path`` as given when it is absolute or exists from the working directory; else the first
    of :data:`RECIPE_ROOTS` under which it exists (so ``configs/tasks/my_prompts.yaml``'s
    ``examples/my_prompts.jsonl`` works from any folder); else as given (the caller refuses it)."""
    file = Path(path)
    if file.is_absolute() or file.exists():
        return file
    for root in RECIPE_ROOTS:
        if (root / file).exists():
            return root / file
    return file


@dataclass(frozen=True)
class Prompt:
    """One task instance.

    Args:
        text: what the policy is conditioned on: tokenized as is, or as the user turn of the
            tokenizer's chat template when it has one (see :func:`encode_prompt`).
        answer: the reference final answer the verifier checks against.
        metadata: anything else the task wants to keep (operands, the reference solution, ...);
            ``"system"`` is the chat's system message and ``"chat_template"`` (True/False)
            forces the template on or off.
    """

    text: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


def uses_chat_template(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> bool:
    """Whether ``prompt`` is rendered with the tokenizer's chat template.

    On when the tokenizer has a template, unless the prompt's source turned it off
    (``prompt.metadata["chat_template"] is False``); a source that asks for it (``True``) with a
    tokenizer that has none gets a ``ValueError``.
    """
    wanted = prompt.metadata.get("chat_template")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if wanted is True and not has_template:
        raise ValueError(
            "chat_template=True, but the tokenizer has no chat template; expected an instruction "
            "model's tokenizer, or chat_template=None/False for plain text prompts."
        )
    return has_template and wanted is not False


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Token ids of one prompt: its chat rendering (system message from ``metadata["system"]``,
    the text as the user turn, the generation prompt appended) when :func:`uses_chat_template`,
    else the system message, a blank line and the text, with the tokenizer's default special
    tokens."""
    system = prompt.metadata.get("system")
    if not uses_chat_template(tokenizer, prompt):
        text = f"{system}\n\n{prompt.text}" if system else prompt.text
        return list(tokenizer(text)["input_ids"])
    messages = [{"role": "user", "content": prompt.text}]
    if system:
        messages.insert(0, {"role": "system", "content": str(system)})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt]
) -> list[list[int]]:
    """Token ids of each prompt (:func:`encode_prompt`); every engine samples from these ids."""
    return [encode_prompt(tokenizer, p) for p in prompts]


class PromptSource(ABC):
    """Where prompts come from.

    Subclasses implement :meth:`sample` (random draws, reproducible from the generator) and
    :meth:`__iter__` (a deterministic order: file order for datasets, a seeded stream for generated
    tasks).
    """

    @abstractmethod
    def sample(self, n: int, generator: torch.Generator) -> list[Prompt]:
        """Draw ``n`` prompts using ``generator`` as the only source of randomness."""

    @abstractmethod
    def __iter__(self) -> Iterator[Prompt]:
        """Prompts in a deterministic order (the same on every call)."""

    def held_out(self) -> PromptSource | None:
        """The prompts kept out of this source's training draws, as a source of their own (the
        default validation prompts of the data modules), or None when it keeps none back."""
        return None


class GeneratedTask(PromptSource):
    """A procedurally generated task: prompts drawn one at a time by :meth:`draw`, each with a
    reference completion (:meth:`reference`) for a supervised warm start.

    Gives :meth:`sample`, a seeded endless :meth:`__iter__` and :meth:`supervised_pairs`; subclasses
    set ``self.seed`` and implement :meth:`draw` and :meth:`reference`. A subclass that takes
    ``split`` and ``held_out_fraction`` and calls :meth:`set_split` gets the disjoint parts of
    ``tasks/split.py``: with ``split="train"`` every draw (warm-start pairs included) skips the
    held-out prompts and :meth:`held_out` is the task drawing only those.
    """

    seed: int
    split: str = "all"
    held_out_fraction: float = 0.1

    def set_split(self, split: str, held_out_fraction: float) -> None:
        """Keep the part of the task this instance draws from (checked: ``tasks/split.py``)."""
        self.split, self.held_out_fraction = check_split(split, held_out_fraction)

    def held_out(self) -> GeneratedTask | None:
        """With ``split="train"``: a copy of this task that draws only the held-out prompts (the
        same arguments and seed); else None (``"all"`` keeps nothing back)."""
        if self.split != "train":
            return None
        part = copy.copy(self)
        part.split = "held_out"
        return part

    def _draw_in_split(self, generator: torch.Generator) -> Prompt:
        """:meth:`draw` until the prompt belongs to ``split`` (one draw for ``"all"``)."""
        for _ in range(MAX_REDRAWS):
            prompt = self.draw(generator)
            if in_split(prompt.text, self.split, self.held_out_fraction):
                return prompt
        raise ValueError(
            f"{type(self).__name__} drew {MAX_REDRAWS} prompts outside split={self.split!r} in a "
            f"row; expected a held_out_fraction ({self.held_out_fraction:g}) that leaves both "
            "parts of the task's prompts non-empty."
        )

    @abstractmethod
    def draw(self, generator: torch.Generator) -> Prompt:
        """One random prompt, ``generator`` its only source of randomness."""

    @abstractmethod
    def reference(self, prompt: Prompt) -> str:
        """The completion a supervised warm start fits for ``prompt`` (without eos)."""

    def sample(self, n: int, generator: torch.Generator) -> list[Prompt]:
        """``n`` random prompts drawn with ``generator``."""
        if n < 0:
            raise ValueError(f"sample got n={n}; expected an integer >= 0.")
        return [self._draw_in_split(generator) for _ in range(n)]

    def __iter__(self) -> Iterator[Prompt]:
        """An endless stream of prompts, identical on every call (seeded by ``seed``)."""
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            yield self._draw_in_split(generator)

    def supervised_pairs(self, n: int, *, seed: int | None = None) -> list[tuple[str, str]]:
        """``n`` ``(prompt text, reference completion)`` pairs for a supervised warm start.

        Args:
            n: number of pairs.
            seed: seed of the draw; None uses ``seed + 1`` so the pairs differ from ``iter(task)``.
        """
        generator = torch.Generator().manual_seed(self.seed + 1 if seed is None else seed)
        return [(p.text, self.reference(p)) for p in self.sample(n, generator)]


class PromptList(PromptSource):
    """A prompt source backed by a list of prompts (``self.prompts``, filled by the subclass).

    Iteration is in list order; :meth:`sample` draws without replacement when ``n <= len(self)``,
    else with replacement.
    """

    prompts: list[Prompt]

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]

    def __iter__(self) -> Iterator[Prompt]:
        """Prompts in list (file or dataset) order."""
        return iter(self.prompts)

    def sample(self, n: int, generator: torch.Generator) -> list[Prompt]:
        """``n`` prompts: without replacement when ``n <= len(self)``, else with replacement."""
        if n < 0:
            raise ValueError(f"sample got n={n}; expected an integer >= 0.")
        if n <= len(self):
            index = torch.randperm(len(self), generator=generator)[:n]
        else:
            index = torch.randint(len(self), (n,), generator=generator)
        return [self.prompts[i] for i in index.tolist()]


class RewardFunction(ABC):
    """Scores a completion; subclass it and point a recipe at it with ``class_path``.

    ``__call__`` returns the scalar reward that is placed on the last action token. ``is_correct``
    says whether the answer is right (used for accuracy logging); the default treats any positive
    reward as correct, so override it when shaping gives partial credit.

    The reward may be any real number type: a Python ``int`` or ``float``, a NumPy scalar or a
    one-element tensor, all read alike as a float. A reward that raises, or returns a ``bool``
    (return ``1.0``/``0.0``, or override :meth:`is_correct`), a non-number, a non-finite value or
    one beyond float32's range (about 3.4e38), drops its sample (counted in
    ``dropped_reward_error``; ``rollout/collect.py``, ``reward_value``). A reward that may not return (a verifier that hangs on a
    pathological answer) needs the data module's ``reward_timeout``: both calls of one sample then
    run in a worker thread, one sample at a time, and are abandoned after that many seconds; an
    abandoned call keeps running (Python cannot stop a thread), so a reward that can hang should
    still bound its own work (``rollout/reward_timeout.py``).
    """

    @abstractmethod
    def __call__(self, prompt: Prompt, completion: str) -> float:
        """Reward of ``completion`` (decoded text, special tokens removed) for ``prompt``."""

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether ``completion`` answers ``prompt`` correctly; default: reward > 0."""
        return self(prompt, completion) > 0.0


class BatchedReward(RewardFunction):
    """A reward that scores a whole rollout batch in one call (a learned reward model: one forward
    over many completions instead of one per completion); subclass it and implement
    :meth:`score_batch`.

    The rollouts call :meth:`score_batch` once per batch with every sample's prompt and
    completion; ``is_correct`` comes from the score alone (:meth:`correct`), so a sample costs one
    score. A score that is not a finite number drops its sample; a call that raises drops the
    batch's samples (each counted in ``dropped_reward_error``); with the data module's
    ``reward_timeout`` the call may take that many seconds per sample.
    """

    @abstractmethod
    def score_batch(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        """One reward per ``(prompts[i], completions[i])``, in order (``len(completions)`` of them)."""

    def correct(self, score: float) -> bool:
        """Whether a completion with reward ``score`` counts as correct; default: score > 0."""
        return score > 0.0

    def __call__(self, prompt: Prompt, completion: str) -> float:
        """The reward of one completion (a batch of one)."""
        return self.score_batch([prompt], [completion])[0]

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """:meth:`correct` of the completion's reward."""
        return self.correct(self(prompt, completion))
