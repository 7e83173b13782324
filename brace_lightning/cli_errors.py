"""Errors found while building the run's objects, reported like parse errors.

jsonargparse reports a wrong type, an unknown key or a bad class path as ``error: <message>`` with
exit code 2. A value it accepts but a class refuses in ``__init__`` (``--data.prompts_per_step=0``,
``--model.value_target.init_args.k=-1``) used to surface as a long traceback, for ``data.*`` options
ending in a dump of the whole data namespace. :func:`construction_errors` turns such a ValueError
into ``error: <option>: <the class's sentence>`` (exit 2, no traceback): the sentence is the
innermost error of the chain, the class is the innermost ``__init__`` of its traceback, and the
option is the config key of that class whose name the sentence mentions. When that error was caused
by another kind (a missing package's ``ImportError`` with its install hint), the cause's message
follows the sentence (:func:`construction_sentence`).

:func:`unknown_option_sentence` completes jsonargparse's ``unrecognized arguments`` with the closest
known option ("did you mean") and, for LightningCLI's ``--optimizer``/``--lr_scheduler`` (not
offered: the two networks have their own), the module's options; :func:`refused_trainer_options`
refuses trainer options the module replaces (``accumulate_grad_batches``) in one sentence, and
:func:`validation_without_batches` a ``validate`` that would score no batch.

:func:`check_config_files` reads every ``--config`` file as YAML before the parser does, so a
malformed file is reported with its path (the parser only names ``"<unicode string>"``).

:func:`overridden_option` finds, on resume, a model option given explicitly whose value the
checkpoint's saved hyperparameters would replace (``fit --ckpt_path CKPT --model.value_target GAE``
on a BRACE checkpoint), for the CLI to refuse in one sentence.
"""

from __future__ import annotations

import contextlib
import difflib
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


def construction_sentence(error: BaseException) -> str:
    """The first line of ``error``'s message, then the whole message of its cause when that is
    not a ValueError (``Problem with given class_path '...WandbLogger': Requirement 'wandb' not met.
    HINT: Try running `pip install ...```): the line alone would drop the reason."""
    sentence = str(error).strip().splitlines()[0]
    cause = error.__cause__
    if cause is not None and not isinstance(cause, ValueError):
        reason = " ".join(line.strip() for line in str(cause).strip().splitlines())
        reason = reason or type(cause).__name__
        # "Problem with given class_path '...':" announces its reason; a full sentence gets it after
        sentence = (
            f"{sentence[:-1]}: {reason}" if sentence.endswith(":") else f"{sentence} ({reason})"
        )
    return sentence


@contextlib.contextmanager
def construction_errors(parser: Any, config: Any) -> Iterator[None]:
    """Report a ValueError raised inside the block as ``error: <option>: <sentence>``, exit 2."""
    try:
        yield
    except ValueError as error:
        inner = _innermost(error)
        option = option_of(inner, config, _raising_class(inner))
        sentence = construction_sentence(inner)
        fail(parser, f"{option}: {sentence}" if option else sentence)


#: LightningCLI's optimizer options that this CLI does not offer, and the module's own.
MODULE_OPTIMIZATION = {
    "--optimizer": (
        "--model.actor_optimizer and --model.critic_optimizer (e.g. --model.actor_optimizer "
        "torch.optim.AdamW --model.actor_optimizer.lr 1e-5)"
    ),
    "--lr_scheduler": (
        "--model.actor_scheduler and --model.critic_scheduler, stepped once per rollout step "
        "(e.g. --model.actor_scheduler torch.optim.lr_scheduler.CosineAnnealingLR "
        "--model.actor_scheduler.T_max 100)"
    ),
}


def unknown_option_sentence(message: str, known: Sequence[str]) -> str:
    """``message`` (jsonargparse's ``unrecognized arguments: --x 1 ...``) with, per unknown
    ``--option``, the module's own options for ``--optimizer``/``--lr_scheduler`` or the closest
    of the ``known`` option strings ("did you mean ..."); other messages are returned unchanged."""
    prefix = "unrecognized arguments:"
    if not message.startswith(prefix):
        return _unaccepted_init_arg(message)
    hints = []
    for word in message[len(prefix) :].split():
        option = word.split("=", 1)[0]
        if not option.startswith("--"):
            continue
        top = option.split(".", 1)[0]
        if top in MODULE_OPTIMIZATION:
            hints.append(
                f"{option} is not offered: the actor and the critic have their own, "
                f"{MODULE_OPTIMIZATION[top]}"
            )
            continue
        close = difflib.get_close_matches(option, known, n=1, cutoff=0.8)
        if close:
            hints.append(f"did you mean {close[0]} (not {option})?")
    return f"{message.rstrip('.')}; {'; '.join(hints)}" if hints else message


_UNACCEPTED = re.compile(
    r"Parser key \"(?P<key>[\w.]+)\".*?class_path '(?P<cls>[\w.]+)'.*?"
    r"Option '(?P<option>\w+)' is not accepted",
    re.DOTALL,
)


def _unaccepted_init_arg(message: str) -> str:
    """jsonargparse's "Option 'x' is not accepted" for a class chosen by ``class_path`` (the data
    module's ``--data.x``), with a last line naming the closest argument of that class."""
    match = _UNACCEPTED.search(message)
    if match is None:
        return message
    try:
        module, _, name = match["cls"].rpartition(".")
        cls = getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError, ValueError):
        return message
    known = {p for klass in inspect.getmro(cls) for p in _init_parameters(klass)}
    close = difflib.get_close_matches(match["option"], sorted(known), n=1, cutoff=0.8)
    if not close:
        return message
    key = match["key"]
    return f"{message}\ndid you mean --{key}.{close[0]} (not --{key}.{match['option']})?"


def _init_parameters(klass: type) -> list[str]:
    init = klass.__dict__.get("__init__")
    if init is None:
        return []
    try:
        parameters = inspect.signature(init).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in parameters if p.name != "self" and p.kind not in kinds]


#: Trainer options the module's own arguments replace: option -> (allowed values, pointer).
REPLACED_TRAINER_OPTIONS: dict[str, tuple[tuple[Any, ...], str]] = {
    "accumulate_grad_batches": (
        (None, 1),
        "the PPO update accumulates gradients itself: set --model.num_minibatches (optimizer "
        "steps per rollout batch), --model.micro_batch_size or "
        "--model.max_tokens_per_micro_batch (rows or tokens per forward/backward)",
    ),
    "gradient_clip_val": (
        (None, 0),
        "each network's gradient norm is clipped by --model.max_grad_norm",
    ),
}


def refused_trainer_options(config: Any) -> str | None:
    """The sentence refusing the first trainer option of :data:`REPLACED_TRAINER_OPTIONS` set to a
    value it does not allow in ``config`` (a subcommand's namespace), or None."""
    for name, (allowed, pointer) in REPLACED_TRAINER_OPTIONS.items():
        value = config.get(f"trainer.{name}")
        if value not in allowed:
            return f"--trainer.{name}={value} is not used by BraceModule: {pointer}."
    return None


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


def config_paths(args: Sequence[str]) -> list[str]:
    """The ``--config``/``-c`` files named on a command line, in order."""
    paths = [b for a, b in zip(args, args[1:], strict=False) if a in ("--config", "-c")]
    return paths + [a.split("=", 1)[1] for a in args if a.startswith(("--config=", "-c="))]


def check_config_files(args: Sequence[str]) -> None:
    """Exit with ``error: --config <path>: ...`` (code 2) when a ``--config``/``-c`` file is not
    YAML."""
    for path in config_paths(args):
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


def validation_without_batches(subcommand: str | None, config: Any) -> str | None:
    """The sentence refusing ``validate`` or ``test`` with ``data.val_batches`` 0 (it would score
    nothing and exit 0 in silence), or None; data modules without ``val_batches`` are left to
    themselves."""
    if subcommand not in ("validate", "test"):
        return None
    val_batches = config.get("data.init_args.val_batches")
    if val_batches is None or val_batches != 0:
        return None
    return (
        f"{subcommand} scores on-policy rollouts but --data.val_batches is 0: set "
        "--data.val_batches N (rollout batches of prompts_per_step prompts to sample and score, "
        "e.g. 2)."
    )
