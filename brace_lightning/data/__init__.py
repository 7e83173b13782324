"""LightningDataModules that feed rollout batches to the trainer.

:class:`RolloutDataModule` generates in the training process, one batch per step, with the trainer's
current weights or those of exactly ``lag`` versions ago. :class:`AsyncRolloutDataModule` generates
in a concurrent producer (a process by default) with staleness bounded by ``max_staleness``.
"""

from brace_lightning.data.async_ import ASYNC_COUNTERS, AsyncRolloutDataModule
from brace_lightning.data.base import (
    COUNTERS,
    EngineFactory,
    PublishTarget,
    RolloutDataModuleBase,
)
from brace_lightning.data.sync import RolloutDataModule

__all__ = [
    "ASYNC_COUNTERS",
    "COUNTERS",
    "AsyncRolloutDataModule",
    "EngineFactory",
    "PublishTarget",
    "RolloutDataModule",
    "RolloutDataModuleBase",
]
