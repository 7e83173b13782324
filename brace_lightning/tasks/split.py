"""Held-out parts of a generated task: which prompts training may see and which only evaluation.

A generated task draws prompts from a finite space (``12+7=`` comes up again and again), so a
validation set drawn from the same task with another seed overlaps the training prompts. The split
here is a function of the prompt text alone: the prompt belongs to the held-out part when the first
8 bytes of ``sha256(text)``, read as a fraction in [0, 1), are below ``held_out_fraction``. The
``"train"`` part redraws every held-out prompt and the ``"held_out"`` part every other one, so the
two cannot share a prompt text, whatever the seeds, and the rule is the same in every process.
"""

from __future__ import annotations

import hashlib

#: ``"all"``: every prompt (no split); ``"train"`` / ``"held_out"``: the two disjoint parts.
SPLITS = ("all", "train", "held_out")

#: Draws a part may take for one prompt before the fraction is called too small (or too large).
MAX_REDRAWS = 1000


def held_out_score(text: str) -> float:
    """The prompt's place in [0, 1): the first 8 bytes of ``sha256(text)`` over 2**64."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def check_split(split: object, held_out_fraction: object) -> tuple[str, float]:
    """``(split, held_out_fraction)`` checked.

    Raises:
        ValueError: for a split not in :data:`SPLITS` or a fraction outside (0, 1).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}.")
    if (
        isinstance(held_out_fraction, bool)
        or not isinstance(held_out_fraction, int | float)
        or not 0.0 < held_out_fraction < 1.0
    ):
        raise ValueError(
            f"held_out_fraction must be a number in (0, 1); got {held_out_fraction!r}."
        )
    return str(split), float(held_out_fraction)


def in_split(text: str, split: str, held_out_fraction: float) -> bool:
    """Whether a prompt with ``text`` belongs to ``split`` (always, for ``"all"``)."""
    if split == "all":
        return True
    return (held_out_score(text) < held_out_fraction) == (split == "held_out")
