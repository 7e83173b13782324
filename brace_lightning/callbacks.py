"""Lightning callbacks of the trainer.

:class:`SupervisedWarmStart` fine-tunes the actor on the task's reference solutions before the first
rollout, so a tiny randomly initialised model starts RL with a non-zero reward (the quickstart
recipe). It runs once: a resumed run skips it (its state is in the checkpoint).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from brace_lightning.checks import require_int
from brace_lightning.models.critic import ValueModel
from brace_lightning.models.warmstart import supervised_warm_start


class SupervisedWarmStart(pl.Callback):
    """Supervised fine-tuning of the actor on ``(prompt, reference solution)`` pairs at fit start.

    The pairs come from ``trainer.datamodule.task.supervised_pairs(num_pairs)``.

    Args:
        num_pairs: number of pairs drawn from the task.
        steps: optimizer steps.
        batch_size: pairs per step.
        lr: peak learning rate (AdamW, warmup then cosine decay).
        copy_to_critic: re-initialise the critic's backbone from the warm-started actor.
        seed: seed of the pair draw and the batch order.
    """

    def __init__(
        self,
        *,
        num_pairs: int = 2000,
        steps: int = 300,
        batch_size: int = 64,
        lr: float = 3e-3,
        copy_to_critic: bool = True,
        seed: int = 0,
    ) -> None:
        for name, value in (("num_pairs", num_pairs), ("steps", steps), ("batch_size", batch_size)):
            require_int(name, value, 1)
        if not lr > 0:
            raise ValueError(f"lr must be > 0; got {lr!r}.")
        self.num_pairs = num_pairs
        self.steps = steps
        self.batch_size = batch_size
        self.lr = lr
        self.copy_to_critic = copy_to_critic
        self.seed = seed
        self.done = False
        self.final_loss: float | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.done:
            return
        task = getattr(trainer.datamodule, "task", None)
        if task is None or not hasattr(task, "supervised_pairs"):
            raise ValueError(
                "SupervisedWarmStart needs trainer.datamodule.task with supervised_pairs(n); "
                f"got {type(task).__name__}."
            )
        pairs = task.supervised_pairs(self.num_pairs, seed=self.seed)
        losses = supervised_warm_start(
            pl_module.actor,
            pl_module.tokenizer,
            pairs,
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            seed=self.seed,
        )
        self.final_loss = losses[-1]
        if self.copy_to_critic:
            fresh = ValueModel.from_actor(pl_module.actor, seed=self.seed + 1)
            pl_module.critic.load_state_dict(fresh.state_dict())
        self.done = True
        if trainer.logger is not None:
            trainer.logger.log_metrics({"warm_start/final_loss": self.final_loss}, step=0)

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "final_loss": self.final_loss}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict["done"])
        self.final_loss = state_dict["final_loss"]
