"""A quiet console: what Lightning and vLLM print that says nothing about a brace_lightning run.

Each silenced message is named with its cause; nothing is filtered by category or by package.

* Lightning's "💡 Tip" advertisements for its hosted services (two per ``fit``) are dropped from
  Lightning's rank-zero logger (:func:`quiet_lightning`, installed by the CLI and by
  ``BraceModule``, which is built before the trainer in Python).
* Two warnings about the ``dataloader_iter`` argument of ``training_step``: the module takes exactly
  one rollout batch from the iterator per step (a step is one PPO update), so ``batch_idx`` and the
  loop's counters are right — the case the warnings say is safe.
* ``ModelCheckpoint`` with manual optimization and ``every_n_train_steps`` "will contain the model
  state AFTER optimization" (13 lines with example code): a checkpoint after rollout step n holds
  the weights and counters after that step's update, which is what resuming at step n + 1 needs.
* ``isinstance(treespec, LeafSpec)`` is deprecated: Lightning's own ``_pytree`` helper on the torch
  version this project pins; nothing a user can change.
* The progress bar's ``v_num`` (the log folder's number, formatted as a metric): the
  :func:`rollout_progress_bar` shows the rollout metrics only (reward, KL(µ‖π), staleness,
  tokens/s, as :mod:`brace_lightning.step_metrics` logs them to the bar).

A reward function that raises on every sample would print one warning per sample (1,280 in a
40-step quickstart): :class:`ErrorsOnce` logs each distinct error (type and message) once per
process, with its traceback and how many samples of the batch it hit; the drops stay counted in
``data/count/dropped_reward_error``.

The empty validation loader's "Total length of `list` across ranks is zero" is avoided at its
cause (the data modules set ``limit_val_batches = 0`` when ``val_batches`` is 0), and vLLM's own
messages are handled in :mod:`brace_lightning.rollout.vllm`.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

#: Messages (regular expressions matched at the start) of harmless Lightning warnings, see above.
HARMLESS_WARNINGS = (
    r"You are using the `dataloader_iter` step flavor",
    r"Found `dataloader_iter` argument in the `training_step`",
    r"Using ModelCheckpoint with manual optimization and every_n_train_steps",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)

#: The loggers Lightning's ``rank_zero_info`` writes to (fabric's and pytorch's).
LIGHTNING_RANK_ZERO_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
)


def silence_harmless_warnings() -> None:
    """Ignore exactly the :data:`HARMLESS_WARNINGS` messages (idempotent)."""
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


class DropMessages(logging.Filter):
    """Drops log records whose message starts with one of ``messages`` (a logger's filter, so it
    holds whichever handlers the library installs later)."""

    def __init__(self, messages: tuple[str, ...]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.messages)


#: Lightning's "💡 Tip:" advertisements.
_DROP_TIPS = DropMessages(("💡 Tip:",))


def quiet_lightning() -> None:
    """Drop Lightning's tips from its rank-zero loggers and silence the harmless warnings
    (idempotent; the CLI and ``BraceModule.__init__`` call it)."""
    for name in LIGHTNING_RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _DROP_TIPS not in logger.filters:
            logger.addFilter(_DROP_TIPS)
    silence_harmless_warnings()


def _without_version(metrics: dict[str, Any]) -> dict[str, Any]:
    metrics.pop("v_num", None)
    return metrics


class RolloutRichProgressBar(RichProgressBar):
    """Lightning's rich progress bar without ``v_num``."""

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))


class RolloutTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar without ``v_num``."""

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))


def rollout_progress_bar() -> ProgressBar:
    """The bar Lightning would pick (rich when installed, else tqdm), without ``v_num``."""
    return RolloutRichProgressBar() if _RICH_AVAILABLE else RolloutTQDMProgressBar()


class ErrorsOnce:
    """Collects the errors of one batch of calls (a reward function over a rollout batch) and
    logs each distinct one (same function, type and message) once per process, with its
    traceback and its count in the batch; a repeat is logged at DEBUG level only.

    Args:
        what: names the calls in the message (``"reward ExactMatch"``).
        log: the logger to write to (the caller's).
    """

    #: (what, error type, message) already shown in this process.
    shown: ClassVar[set[tuple[str, str, str]]] = set()

    def __init__(self, what: str, log: logging.Logger) -> None:
        self.what = what
        self.log = log
        self.errors: list[BaseException] = []

    def add(self, error: BaseException) -> None:
        self.errors.append(error)

    def report(self, total: int, consequence: str) -> None:
        """Log the new errors among the collected ones, ``total`` calls in all, each followed by
        ``consequence`` (what happened to the samples)."""
        counts = Counter((type(e).__name__, str(e)) for e in self.errors)
        first = {(type(e).__name__, str(e)): e for e in reversed(self.errors)}
        for (kind, message), count in counts.items():
            key = (self.what, kind, message)
            if key in ErrorsOnce.shown:
                self.log.debug(
                    "%s raised %s on %d of %d samples again", self.what, kind, count, total
                )
                continue
            ErrorsOnce.shown.add(key)
            self.log.warning(
                "%s raised %s: %s on %d of %d samples of a rollout batch; %s (this error is "
                "shown once, with its traceback):",
                self.what,
                kind,
                message,
                count,
                total,
                consequence,
                exc_info=first[(kind, message)],
            )
