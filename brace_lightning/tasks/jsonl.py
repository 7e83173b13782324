"""Reading JSONL files: one JSON value per non-blank line, each named by its file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[tuple[str, Any]]:
    """The parsed non-blank lines of ``path`` as ``(where, value)``, ``where`` = ``"path:line"``
    (callers check the values' shape and name ``where`` in their errors).

    Raises:
        ValueError: for a line that is not UTF-8 or not valid JSON (the message names the file and
            the line).
    """
    values = []
    with path.open("rb") as lines:  # bytes: a line that is not UTF-8 is named by its number
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{path}:{number}: byte {error.start + 1} of the line is not UTF-8 "
                    f"({raw[error.start : error.start + 1]!r}); expected a UTF-8 text file."
                ) from None
            if not line.strip():
                continue
            try:
                values.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{number}: invalid JSON ({error.msg}); expected one object per line."
                ) from None
    return values


def shown(value: Any) -> str:
    """``value`` as JSON, cut to 80 characters, for an error message."""
    return repr(json.dumps(value, default=repr)[:80])
