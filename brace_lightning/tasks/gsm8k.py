"""GSM8K-format math word problems: loaders, final-answer extraction and a numeric verifier.

Records have a ``question`` and an ``answer`` whose last line is ``#### <number>`` (the GSM8K
format). They come from a local JSONL file (one JSON object per line, blank lines skipped) or from
the Hugging Face hub through the optional ``datasets`` package (imported only when used).

Answer extraction (:func:`extract_final_answer`): the first number after the last ``####`` if there
is one, else the last number in the text; thousands separators and ``$`` are dropped. Verification
compares numerically with :class:`decimal.Decimal` (``18`` == ``18.00``); no units, fractions or
expressions are interpreted.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

import torch

from brace_lightning.tasks.base import Prompt, PromptList, RewardFunction
from brace_lightning.tasks.jsonl import read_jsonl, shown

DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _normalise_number(token: str) -> str:
    return token.replace(",", "").replace("$", "")


def extract_final_answer(text: str) -> str | None:
    """The final numeric answer of a solution or completion, or None when there is none.

    Examples: ``"... #### 1,234"`` → ``"1234"``; ``"so she pays $18.50."`` → ``"18.50"``.
    """
    if "####" in text:
        match = _NUMBER.search(text.rsplit("####", 1)[1])
        return _normalise_number(match.group()) if match else None
    numbers = _NUMBER.findall(text)
    return _normalise_number(numbers[-1]) if numbers else None


def answers_match(predicted: str | None, reference: str) -> bool:
    """Whether two extracted answers are the same number (``"18"`` matches ``"18.00"``)."""
    if predicted is None:
        return False
    try:
        return Decimal(predicted) == Decimal(reference)
    except InvalidOperation:
        return False


def _to_prompt(question: str, solution: str, template: str, source: str) -> Prompt:
    answer = extract_final_answer(solution) if "####" in solution else None
    if answer is None:
        raise ValueError(
            f"{source}: answer has no '#### <number>' final line; expected GSM8K format."
        )
    return Prompt(
        text=template.format(question=question),
        answer=answer,
        metadata={"solution": solution, "source": source},
    )


def load_gsm8k_jsonl(path: str | Path, *, prompt_template: str = DEFAULT_TEMPLATE) -> list[Prompt]:
    """Read GSM8K records from a JSONL file.

    Args:
        path: a file with one ``{"question": str, "answer": str}`` object per line.
        prompt_template: format string with a ``{question}`` field.

    Raises:
        FileNotFoundError: when ``path`` does not exist (the message names it).
        ValueError: for a line that is not a JSON object with string ``question`` and ``answer`` and a
            ``####`` final answer (the message names the file and the line number).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file {str(path)!r} does not exist.")
    prompts = []
    for where, record in read_jsonl(path):
        if not isinstance(record, dict) or not all(
            isinstance(record.get(key), str) for key in ("question", "answer")
        ):
            raise ValueError(
                f"{where}: got {shown(record)}; expected an object with string fields "
                "'question' and 'answer'."
            )
        prompts.append(_to_prompt(record["question"], record["answer"], prompt_template, where))
    return prompts


def load_gsm8k_hub(
    name: str = "openai/gsm8k",
    *,
    config: str = "main",
    split: str = "train",
    prompt_template: str = DEFAULT_TEMPLATE,
) -> list[Prompt]:
    """Download GSM8K (or a dataset with the same fields) with Hugging Face ``datasets``.

    Raises:
        ImportError: when ``datasets`` is not installed.
    """
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            "Loading GSM8K from the Hugging Face hub needs the `datasets` package: "
            "`pip install datasets` (or pass a local JSONL file)."
        ) from error
    rows = datasets.load_dataset(name, config, split=split)
    return [
        _to_prompt(row["question"], row["answer"], prompt_template, f"{name}/{split}[{i}]")
        for i, row in enumerate(rows)
    ]


class GSM8K(PromptList):
    """GSM8K prompts from a local JSONL file or a hub dataset.

    Args:
        source: a path ending in ``.jsonl``/``.json`` or naming an existing file (read locally), or a
            hub dataset name such as ``"openai/gsm8k"`` (needs ``datasets``).
        split: hub split; ignored for files.
        config: hub config name; ignored for files.
        prompt_template: format string with a ``{question}`` field.
    """

    def __init__(
        self,
        source: str = "openai/gsm8k",
        *,
        split: str = "train",
        config: str = "main",
        prompt_template: str = DEFAULT_TEMPLATE,
    ) -> None:
        if "{question}" not in prompt_template:
            raise ValueError(
                f"GSM8K got prompt_template={prompt_template!r}; expected a '{{question}}' field."
            )
        if source.endswith((".jsonl", ".json")) or Path(source).is_file():
            self.prompts = load_gsm8k_jsonl(source, prompt_template=prompt_template)
        else:
            self.prompts = load_gsm8k_hub(
                source, config=config, split=split, prompt_template=prompt_template
            )
        if not self.prompts:
            raise ValueError(f"GSM8K got source={source!r} with no records; expected at least one.")

    def supervised_pairs(self, n: int | None = None, *, seed: int = 0) -> list[tuple[str, str]]:
        """``(prompt text, " " + reference solution)`` pairs for a supervised warm start.

        Args:
            n: number of pairs, drawn with :meth:`sample`; None gives every record in order.
            seed: seed of the draw when ``n`` is given.
        """
        prompts = self.prompts if n is None else self.sample(n, torch.Generator().manual_seed(seed))
        return [(p.text, " " + p.metadata["solution"]) for p in prompts]


class GSM8KReward(RewardFunction):
    """1.0 when the completion's final number equals the reference answer, else 0.0.

    Args:
        strict: only accept an answer written after ``####`` (the GSM8K format); when False, the
            last number of the completion counts if there is no ``####``.
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = bool(strict)

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if self.is_correct(prompt, completion) else 0.0

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether the extracted final answer equals ``prompt.answer`` numerically."""
        if self.strict and "####" not in completion:
            return False
        return answers_match(extract_final_answer(completion), prompt.answer)
