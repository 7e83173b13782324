"""Resuming a checkpoint with the data module that wrote it, or refusing with one sentence.

The two data modules keep different state: :class:`~brace_lightning.data.RolloutDataModule` a lag
history of weights and no buffer, :class:`~brace_lightning.data.AsyncRolloutDataModule` buffered
samples, admission counters and its producer's RNG. Lightning restores a data module's state only
when the checkpoint has an entry under that module's class name, so switching modules between save
and resume silently started the new one from scratch: an async module at version 0 while the policy
was at 3 (its next batch then counted as 4 versions stale), or a sync module that neither trained
nor counted the 12 samples the async one had buffered. Rather than translate one state into the
other, a resume with another data module is refused before the first step.
"""

from __future__ import annotations

from typing import Any

#: Key of the LightningModule's checkpoint entry that names the data module.
RECORD_KEY = "data_module"

_KNOWN = ("RolloutDataModule", "AsyncRolloutDataModule")


def data_module_name(datamodule: Any) -> str | None:
    """What :func:`check_same_data_module` compares: the data module's class name, or None."""
    return None if datamodule is None else type(datamodule).__qualname__


def check_same_data_module(checkpoint: dict[str, Any], saved: str | None, datamodule: Any) -> None:
    """Raise ValueError when ``checkpoint`` was written with a data module other than ``datamodule``.

    Args:
        checkpoint: the Lightning checkpoint being loaded.
        saved: the data module's class name recorded at save time (None in older checkpoints, which
            are then judged by the data-module entries Lightning stored).
        datamodule: the run's data module (None: nothing to compare).
    """
    current = data_module_name(datamodule)
    if current is None:
        return
    if saved is None:  # older checkpoint: the class name of a stored rollout data module state
        stored = [name for name in _KNOWN if name in checkpoint]
        saved = stored[0] if stored and current not in checkpoint else None
    if saved is not None and saved != current:
        raise ValueError(
            f"the checkpoint was written with the data module {saved} but this run uses {current}; "
            "expected the same data module, because its policy versions, counters, prompt stream "
            f"and buffered samples do not carry across (resume with {saved}'s recipe)."
        )
