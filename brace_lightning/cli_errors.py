"""Errors found while building the run's objects, reported like parse errors.

jsonargparse reports a wrong type, an unknown key or a bad class path as ``error: <message>`` with
exit code 2. A value it accepts but a class refuses in ``__init__`` (``--data.prompts_per_step=0``,
``--model.value_target.init_args.k=-1``) used to surface as a long traceback, for ``data.*`` options
ending in a dump of the whole data namespace. :func:`construction_errors` turns such a ValueError
into ``error: <option>: <the class's sentence>`` (exit 2, no traceback): the sentence is the
innermost error of the chain, the class is the innermost ``__init__`` of its traceback, and the
option is the config key of that class whose name the sentence mentions.

:func:`check_config_files` reads every ``--config`` file as YAML before the parser does, so a
malformed file is reported with its path (the parser only names ``"<unicode string>"``).

:func:`overridden_option` finds, on resume, a model option given explicitly whose value the
checkpoint's saved hyperparameters would replace (``fit --ckpt_path CKPT --model.value_target GAE``
on a BRACE checkpoint), for the CLI to refuse in one sentence.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

from brace_lightning.rollout.engine import PromptLimit, check_sampling_args

_NAMED = re.compile(r"^(\w+) must\b|\bgot (\w+)=")


def _innermost(error: BaseException) -> BaseException:
    while isinstance(error.__cause__, ValueError):
        error = error.__cause__
    return error


def _raising_class(error: BaseException) -> type | None:
    """The class whose ``__init__`` is the innermost one on ``error``'s traceback."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__init__" and "self" in frame.f_locals:
            found = type(frame.f_locals["self"])
        tb = tb.tb_next
    return found


def _display(key: str) -> str:
    # LightningCLI accepts data.<arg> for data.init_args.<arg>; write it the way users type it.
    return "data." + key[len("data.init_args.") :] if key.startswith("data.init_args.") else key


def option_of(error: BaseException, config: Any, owner: type | None) -> str | None:
    """The config key (``model.ppo_epochs``) that the sentence of ``error`` is about, or None.

    Args:
        error: the innermost error; its message starts with ``"<arg> must"`` or holds
            ``"got <arg>="``.
        config: the subcommand's config namespace (flattened keys via ``keys()``).
        owner: the class that raised, to choose among keys with the same last name.
    """
    match = _NAMED.search(str(error))
    if match is None:
        return None
    name = match.group(1) or match.group(2)
    keys = [k for k in config.keys() if k.split(".")[-1] == name]
    if owner is not None and len(keys) > 1:

        def owned(key: str) -> bool:
            prefix = key.rsplit(".", 2)[0] if ".init_args." in key else ""
            class_path = config.get(f"{prefix}.class_path") if prefix else None
            if class_path is not None:
                return str(class_path).split(".")[-1] == owner.__name__
            return key.count(".") == 1 and key.startswith("model.")  # the LightningModule's own

        keys = [k for k in keys if owned(k)] or keys
    return _display(keys[0]) if len(keys) == 1 else None


def fail(parser: Any, message: str) -> NoReturn:
    """Print ``error: message`` the way the parser reports parse errors and exit with code 2."""
    error = getattr(parser, "error", None)
    if error is not None:
        error(message)  # jsonargparse: usage, "error: ...", SystemExit(2)
    sys.stderr.write(f"error: {message}\n")
    raise SystemExit(2)


@contextlib.contextmanager
def construction_errors(parser: Any, config: Any) -> Iterator[None]:
    """Report a ValueError raised inside the block as ``error: <option>: <sentence>``, exit 2."""
    try:
        yield
    except ValueError as error:
        inner = _innermost(error)
        option = option_of(inner, config, _raising_class(inner))
        sentence = str(inner).strip().splitlines()[0]
        fail(parser, f"{option}: {sentence}" if option else sentence)


def check_engine_factory(factory: Any) -> None:
    """Run the sampling- and prompt-argument checks of an engine factory's class before any model
    exists.

    Engines are built lazily from a factory (the first batch, or a producer process), so a bad
    ``--data.engine.init_args.max_new_tokens`` would otherwise only fail in the middle of ``fit``.
    """
    from brace_lightning.rollout.workers import portable_factory

    factory = portable_factory(factory)
    cls = getattr(factory, "func", None)
    if not isinstance(cls, type):
        return
    parameters = inspect.signature(cls).parameters
    names = ("temperature", "top_p", "max_new_tokens")
    if not all(n in parameters for n in names):
        return
    given = {n: factory.keywords.get(n, parameters[n].default) for n in names}
    check_sampling_args(cls.__name__, **given)
    if "max_prompt_tokens" in parameters and "truncation" in parameters:
        limit, truncation = (
            factory.keywords.get(n, parameters[n].default)
            for n in ("max_prompt_tokens", "truncation")
        )
        PromptLimit(cls.__name__, limit, truncation, None, given["max_new_tokens"])


def check_config_files(args: Sequence[str]) -> None:
    """Exit with ``error: --config <path>: ...`` (code 2) when a ``--config``/``-c`` file is not
    YAML."""
    paths = [b for a, b in zip(args, args[1:], strict=False) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in args if a.startswith(("--config=", "-c="))]
    for path in paths:
        file = Path(path)
        if not file.is_file():
            continue  # the parser reports a missing file itself
        try:
            yaml.safe_load(file.read_text())
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            fail(None, f"--config {path}: not valid YAML{where} ({problem}).")


def overridden_option(
    explicit: Sequence[str], given: Any, saved: Any, ckpt_path: str | Path
) -> str | None:
    """The sentence refusing the first of the ``explicit`` model options whose value in ``given``
    (the parsed command line and ``--config`` files) differs from ``saved`` (the same config after
    LightningCLI copied the checkpoint's hyperparameters into it), or None when none differs.

    Args:
        explicit: flattened ``model.*`` keys given on the command line or in a ``--config`` file
            (a ``parse_args(defaults=False)``), in the order given.
        given: the subcommand's config namespace before the copy.
        saved: the same namespace after the copy.
        ckpt_path: the checkpoint, named in the sentence.
    """
    for key in explicit:
        mine, theirs = given.get(key), saved.get(key)
        if key in saved and mine == theirs:
            continue
        if key not in saved and ".init_args." in key:  # the checkpoint's component is another class
            key = key.split(".init_args.")[0] + ".class_path"
            mine, theirs = given.get(key), saved.get(key)
        option = key.removesuffix(".class_path")
        return (
            f"--{option}={mine} differs from the value {theirs} saved in "
            f"ckpt_path={str(ckpt_path)!r}: resume with the checkpoint's value or start a new run."
        )
    return None
