"""Counting: list every integer from ``a`` to ``b``; a long response whose every step is checked.

A prompt names the two ends; the reference solution lists the integers between them, separated by
``;``, and the reward is 1 only when the whole list is right (the model ends it with eos)::

    prompt:    137:141=
    solution:  137;138;139;140;141

Each step only increments the previous number (carries included), and the stop depends on ``b``
in the prompt, so a tiny model learns the task from a short supervised warm start; what it has to
learn by reinforcement is to make no slip over a long response: at temperature 1 a small
per-token error rate compounds over ~160 tokens. The response length is dialled by ``span`` (the
number of integers listed) and by the digits of the ends: three-digit numbers and ``span`` 40 give
159 characters (tokens, with the character-level tokenizer). Only the final list is scored, on the
last token, so a critic has to carry the reward back over the whole response: the long-horizon
setting of the paper's critic-side correction, at a size a CPU trains.
"""

from __future__ import annotations

import torch

from brace_lightning.seeds import run_seed
from brace_lightning.tasks.base import GeneratedTask, Prompt, RewardFunction

_MAX_COMPLETION_CHARS = 100_000


def _is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def count_solution(start: int, stop: int) -> str:
    """The reference completion for ``start:stop=``: every integer from ``start`` to ``stop``.

    >>> count_solution(98, 101)
    '98;99;100;101'
    """
    if start > stop:
        raise ValueError(f"count_solution got start={start} > stop={stop}; expected start <= stop.")
    return ";".join(str(n) for n in range(start, stop + 1))


class CountingTask(GeneratedTask):
    """Random counting prompts ``a:b=`` with the list ``a;a+1;...;b`` as reference solution.

    Args:
        span: integers listed per prompt, an integer or an inclusive range ``(low, high)``; the
            response has about ``span * (digits + 1)`` characters.
        low: smallest start ``a``.
        high: largest end ``b``; starts are drawn uniformly so that ``a + span - 1 <= high``.
        seed: seed of the deterministic stream returned by ``iter(task)`` (None: the run's
            ``seed_everything``, see ``brace_lightning.seeds``).
        end_multiple: when set, every list ends at a multiple of it (e.g. 100: ``152:200=``), so
            where to stop shows in the numbers themselves and not only in the prompt's ``b``; the
            ends are drawn uniformly among the multiples in range.
        split: ``"all"`` (every prompt), ``"train"`` (never a held-out prompt; validation then
            draws the held-out ones) or ``"held_out"`` (only those): ``tasks/split.py``.
        held_out_fraction: the share of prompt texts held out when ``split`` is not ``"all"``.
    """

    def __init__(
        self,
        span: int | tuple[int, int] = (38, 48),
        low: int = 100,
        high: int = 999,
        seed: int | None = None,
        end_multiple: int | None = None,
        split: str = "all",
        held_out_fraction: float = 0.1,
    ) -> None:
        pair = (span, span) if _is_int(span) else span
        span_low, span_high = pair if isinstance(pair, tuple | list) and len(pair) == 2 else (0, 0)
        if not (_is_int(span_low) and _is_int(span_high) and 2 <= span_low <= span_high):
            raise ValueError(
                f"CountingTask got span={span!r}; expected an integer >= 2 or a range (low, high) "
                "with 2 <= low <= high."
            )
        if not (_is_int(low) and _is_int(high)) or low < 0 or high - low + 1 < span_high:
            raise ValueError(
                f"CountingTask got low={low!r}, high={high!r}; expected 0 <= low and room for the "
                f"longest span ({span_high} integers) between them."
            )
        if end_multiple is not None and not (
            _is_int(end_multiple)
            and end_multiple >= 1
            and low + span_high - 1 <= (high // end_multiple) * end_multiple
        ):
            raise ValueError(
                f"CountingTask got end_multiple={end_multiple!r}; expected None or an integer >= 1 "
                f"with a multiple of it in [{low + span_high - 1}, {high}] to end the longest span."
            )
        self.end_multiple = None if end_multiple is None else int(end_multiple)
        self.span = (int(span_low), int(span_high))
        self.low = int(low)
        self.high = int(high)
        self.seed = run_seed(seed)
        self.set_split(split, held_out_fraction)

    def draw(self, generator: torch.Generator) -> Prompt:
        """One random prompt drawn with ``generator``."""
        span = int(torch.randint(self.span[0], self.span[1] + 1, (), generator=generator))
        if self.end_multiple is None:
            start = int(torch.randint(self.low, self.high - span + 2, (), generator=generator))
            stop = start + span - 1
        else:
            m = self.end_multiple
            first, last = -(-(self.low + span - 1) // m), self.high // m
            stop = m * int(torch.randint(first, last + 1, (), generator=generator))
            start = stop - span + 1
        return Prompt(
            text=f"{start}:{stop}=",
            answer=count_solution(start, stop),
            metadata={"start": start, "stop": stop},
        )

    @staticmethod
    def solution(prompt: Prompt) -> str:
        """The reference completion of a counting ``prompt`` (without eos): its answer, the list."""
        return prompt.answer

    def reference(self, prompt: Prompt) -> str:
        """The warm start's completion: :meth:`solution`."""
        return self.solution(prompt)


def correct_prefix(completion: str, solution: str) -> int:
    """How many leading integers of ``completion`` (split at ``;``) match ``solution``'s."""
    listed = completion.strip()[:_MAX_COMPLETION_CHARS].split(";")
    expected = solution.split(";")
    count = 0
    for got, want in zip(listed, expected, strict=False):
        if got.strip() != want:
            break
        count += 1
    return count


class CountingReward(RewardFunction):
    """1.0 for the exact list (surrounding whitespace ignored), else ``partial`` × the fraction of
    the list that is right before the first slip.

    Args:
        partial: weight of the partial credit, in ``[0, 1)``; 0 (default) makes the reward exact
            match only, so every step of the response is checked by one terminal reward.
    """

    def __init__(self, partial: float = 0.0) -> None:
        if not 0.0 <= partial < 1.0:
            raise ValueError(f"CountingReward got partial={partial}; expected a value in [0, 1).")
        self.partial = float(partial)

    def __call__(self, prompt: Prompt, completion: str) -> float:
        if self.is_correct(prompt, completion):
            return 1.0
        if self.partial == 0.0:
            return 0.0
        expected = prompt.answer.split(";")
        return self.partial * correct_prefix(completion, prompt.answer) / len(expected)

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether ``completion`` lists exactly the integers of ``prompt.answer``."""
        return completion.strip() == prompt.answer
