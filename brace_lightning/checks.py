"""Argument checks shared by the config-taking classes (data modules, the module, callbacks).

Each raises ValueError with one sentence naming the argument, the value and what is expected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def require_bool(name: str, value: object) -> None:
    """Raise ValueError unless ``value`` is a bool (``name`` is the argument it came from)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool; got {value!r}.")


def require_int(name: str, value: object, low: int) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) and at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}.")


@contextlib.contextmanager
def blame(rollout_step: int, component: object) -> Iterator[None]:
    """Prefix a ValueError raised by ``component`` with the rollout step and the component."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"rollout step {rollout_step}, {component!r}: {error}") from error
