"""The commands and code snippets of README.md and docs/*.md, read the way a reader copies them (the
one parser the tests that run documented lines share).

A command is a line of a shell code block (```bash, ```sh, ```shell, ```console or a fence without a
language) with its ``\\`` continuations joined and comments dropped, or an inline code span in the
prose that starts like a command (``.venv/bin/...``, ``bash ...``, ``pip ...``, ``python ...``,
``brace-lightning ...``, ``nice ...``, optionally after ``NAME=value`` environment settings). Other
fenced blocks (```python, ```text, ```bibtex) are not commands; ```text holds usage forms with
placeholders, which cannot run as written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
SHELL_LANGUAGES = frozenset({"", "bash", "sh", "shell", "console"})
INLINE_COMMAND = re.compile(
    r"(?:[A-Z_][A-Z0-9_]*=\S+ )*(?:\.venv/bin/|bash |sh |pip |python |brace-lightning |nice )"
)
_FENCE = re.compile(r"^\s*```\s*([\w+-]*)")


@dataclass(frozen=True)
class Command:
    """One documented command: the line as it would be pasted into a shell, and where it is."""

    line: str
    lineno: int  # line of its file the command starts on (1-based)
    inline: bool  # an inline code span in the prose, not a code-block line
    file: str = "README.md"  # its file, relative to the repository


@dataclass(frozen=True)
class Block:
    language: str  # the fence's info string ("" without one)
    lineno: int  # line of the opening fence (1-based)
    end: int  # line of the closing fence
    body: str


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced code block of a Markdown text, in order."""
    blocks: list[Block] = []
    opened: tuple[str, int, list[str]] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        fence = _FENCE.match(line)
        if opened is None:
            if fence:
                opened = (fence.group(1).lower(), number, [])
        elif fence and line.strip() == "```":
            blocks.append(Block(opened[0], opened[1], number, "\n".join(opened[2])))
            opened = None
        else:
            opened[2].append(line)
    if opened is not None:
        raise ValueError(f"README.md: the code block opened on line {opened[1]} is not closed")
    return blocks


def strip_comment(line: str) -> str:
    """``line`` without a shell comment (``#`` at a word start, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def command_lines(body: str, first_lineno: int = 1) -> list[tuple[int, str]]:
    """(line number, command) of a shell block: continuations joined, comments and blanks dropped."""
    commands: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for offset, raw in enumerate(body.splitlines()):
        line = strip_comment(raw.strip())
        if pending is not None:
            line = f"{pending[1]} {line}".strip()
        start = pending[0] if pending is not None else first_lineno + offset
        if line.endswith("\\"):
            pending = (start, line[:-1].rstrip())
            continue
        pending = None
        if line:
            commands.append((start, line))
    if pending is not None:
        commands.append(pending)
    return commands


def _without_blocks(text: str) -> str:
    """The prose of a Markdown text: fenced blocks blanked out, line numbers kept."""
    lines = text.splitlines()
    for block in fenced_blocks(text):
        for index in range(block.lineno - 1, block.end):
            lines[index] = ""
    return "\n".join(lines)


def readme_commands(text: str | None = None, file: str = "README.md") -> list[Command]:
    """Every command in README.md (or ``text``, from ``file``): code-block lines first, then inline
    commands."""
    text = README.read_text() if text is None else text
    commands = [
        Command(line, lineno, inline=False, file=file)
        for block in fenced_blocks(text)
        if block.language in SHELL_LANGUAGES
        for lineno, line in command_lines(block.body, block.lineno + 1)
    ]
    prose = _without_blocks(text)
    for span in re.finditer(r"`([^`]+)`", prose):
        line = " ".join(span.group(1).split())
        if INLINE_COMMAND.match(line):
            lineno = prose.count("\n", 0, span.start()) + 1
            commands.append(Command(line, lineno, inline=True, file=file))
    return commands


def docs_commands() -> list[Command]:
    """Every command in docs/*.md, file by file in name order."""
    return [
        command
        for path in sorted(DOCS.glob("*.md"))
        for command in readme_commands(path.read_text(), str(path.relative_to(REPO)))
    ]


def indented_commands(text: str) -> list[int]:
    """Lines of an indented (unfenced) code block that start like a command: the parser does not
    read such blocks, so documented commands must be fenced."""
    prose = _without_blocks(text).splitlines()
    return [
        number
        for number, line in enumerate(prose, start=1)
        if line.startswith("    ") and INLINE_COMMAND.match(line.strip())
    ]


def python_snippets(text: str | None = None) -> list[Block]:
    """README.md's ```python blocks."""
    text = README.read_text() if text is None else text
    return [block for block in fenced_blocks(text) if block.language == "python"]
