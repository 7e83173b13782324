"""Your own prompts: a generic source over JSONL files and Hugging Face datasets.

Each record is mapped to a :class:`~brace_lightning.tasks.base.Prompt` by field names: the prompt
text from ``prompt_field`` (formatted through ``template``), the reference answer from
``answer_field`` (given to the reward function as ``prompt.answer``), every other field kept in
``prompt.metadata`` so a custom reward can use it. A recipe::

    data:
      init_args:
        task:
          class_path: brace_lightning.tasks.JSONLPrompts
          init_args: {path: my_prompts.jsonl, prompt_field: question, answer_field: label,
                      system_prompt: "Answer with a number."}
        reward:
          class_path: my_reward.ExactMatch      # a module in the working directory

With a tokenizer that has a chat template (instruction models), the prompt text becomes the user
turn and ``system_prompt`` the system turn (``chat_template: false`` turns this off); without one,
``system_prompt`` is prepended to the text followed by a blank line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from brace_lightning.tasks.base import Prompt, PromptList, resolve_data_path
from brace_lightning.tasks.jsonl import read_jsonl, shown


def record_to_prompt(
    record: Mapping[str, Any],
    *,
    prompt_field: str,
    answer_field: str | None,
    template: str,
    system_prompt: str | None,
    chat_template: bool | None,
    where: str,
) -> Prompt:
    """One record as a :class:`Prompt`; ``where`` (file:line or dataset[index]) names it in errors.

    The prompt field must hold a string and the answer field a string or a number (kept as its
    text): a null, list or object is refused rather than turned into text such as ``"None"``.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: got {type(record).__name__}; expected a JSON object.")
    for name, field in (("prompt_field", prompt_field), ("answer_field", answer_field)):
        if field is not None and field not in record:
            raise ValueError(
                f"{where}: {name}={field!r} is not a field of the record (fields: "
                f"{sorted(record)}); expected one of them."
            )
    if not isinstance(record[prompt_field], str):
        raise ValueError(
            f"{where}: prompt_field={prompt_field!r} holds {shown(record[prompt_field])}; expected "
            "a string."
        )
    if answer_field is not None and (
        record[answer_field] is None or isinstance(record[answer_field], dict | list)
    ):
        raise ValueError(
            f"{where}: answer_field={answer_field!r} holds {shown(record[answer_field])}; expected "
            "a string or a number (or answer_field=None for prompts without a reference)."
        )
    text = template.format(prompt=record[prompt_field])
    metadata: dict[str, Any] = {k: v for k, v in record.items() if k not in (prompt_field,)}
    metadata["source"] = where
    if chat_template is not None:
        metadata["chat_template"] = chat_template
    if system_prompt:
        metadata["system"] = system_prompt
    answer = "" if answer_field is None else str(record[answer_field])
    return Prompt(text=text, answer=answer, metadata=metadata)


class _MappedPrompts(PromptList):
    """Shared argument checks and record mapping of the JSONL and dataset sources."""

    def _fill(self, records: Iterable[tuple[str, Mapping[str, Any]]], source: str) -> None:
        self.prompts = [
            record_to_prompt(
                record,
                prompt_field=self.prompt_field,
                answer_field=self.answer_field,
                template=self.template,
                system_prompt=self.system_prompt,
                chat_template=self.chat_template,
                where=where,
            )
            for where, record in records
        ]
        if self.limit is not None:
            self.prompts = self.prompts[: self.limit]
        if not self.prompts:
            raise ValueError(f"{source} holds no records; expected at least one.")

    def _set_mapping(
        self,
        prompt_field: str,
        answer_field: str | None,
        template: str,
        system_prompt: str | None,
        chat_template: bool | None,
        limit: int | None,
    ) -> None:
        if "{prompt}" not in template:
            raise ValueError(f"template={template!r} has no '{{prompt}}' field; expected one.")
        if limit is not None and limit < 1:
            raise ValueError(f"limit={limit}; expected None or an integer >= 1.")
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.template = template
        self.system_prompt = system_prompt
        self.chat_template = chat_template
        self.limit = limit


class JSONLPrompts(_MappedPrompts):
    """Prompts from a JSONL file (one JSON object per line; blank lines skipped).

    Args:
        path: the file.
        prompt_field: the field holding the prompt text.
        answer_field: the field holding the reference answer (None: no reference; the reward
            function then judges the completion alone).
        template: format string with a ``{prompt}`` field applied to the prompt text.
        system_prompt: optional system message (see the module docstring).
        chat_template: None applies the tokenizer's chat template when it has one; True requires
            one; False never applies it.
        limit: keep only the first ``limit`` records.
    """

    def __init__(
        self,
        path: str,
        *,
        prompt_field: str = "prompt",
        answer_field: str | None = "answer",
        template: str = "{prompt}",
        system_prompt: str | None = None,
        chat_template: bool | None = None,
        limit: int | None = None,
    ) -> None:
        self._set_mapping(prompt_field, answer_field, template, system_prompt, chat_template, limit)
        file = resolve_data_path(path)
        if not file.is_file():
            raise ValueError(
                f"JSONLPrompts got path={path!r}; expected an existing JSONL file (a relative path "
                "is read from the working directory, else from the project folder of a --config)."
            )
        self._fill(read_jsonl(file), f"JSONL file {path!r}")


class HFPrompts(_MappedPrompts):
    """Prompts from a Hugging Face dataset (hub name or local folder; needs ``datasets``:
    ``pip install -e ".[datasets]"``).

    Args:
        name: the dataset (``load_dataset`` first argument).
        config: the dataset's config name, if it has several.
        split: the split.
        prompt_field, answer_field, template, system_prompt, chat_template, limit: as in
            :class:`JSONLPrompts`.
    """

    def __init__(
        self,
        name: str,
        *,
        config: str | None = None,
        split: str = "train",
        prompt_field: str = "prompt",
        answer_field: str | None = "answer",
        template: str = "{prompt}",
        system_prompt: str | None = None,
        chat_template: bool | None = None,
        limit: int | None = None,
    ) -> None:
        self._set_mapping(prompt_field, answer_field, template, system_prompt, chat_template, limit)
        try:
            import datasets
        except ImportError as error:
            raise ImportError(
                "HFPrompts needs the `datasets` package: pip install -e '.[datasets]' "
                "(or use JSONLPrompts with a local file)."
            ) from error
        rows = datasets.load_dataset(name, config, split=split)
        self._fill(
            ((f"{name}/{split}[{i}]", row) for i, row in enumerate(rows)), f"dataset {name!r}"
        )
