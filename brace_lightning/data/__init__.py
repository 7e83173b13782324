"""LightningDataModules that feed rollout batches to the trainer.

:class:`RolloutDataModule` generates in the training process, one batch per step, with the trainer's
current weights or those of exactly ``lag`` versions ago.
"""

from brace_lightning.data.sync import COUNTERS, EngineFactory, RolloutDataModule

__all__ = ["COUNTERS", "EngineFactory", "RolloutDataModule"]
