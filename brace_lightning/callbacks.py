"""Lightning callbacks of the trainer.

:class:`SupervisedWarmStart` fine-tunes the actor on the task's reference solutions before the first
rollout, so a tiny randomly initialised model starts RL with a non-zero reward (the quickstart
recipe). It runs once, in ``setup`` before the strategy shards or wraps the model (so it works the
same under DDP and FSDP2: every rank trains its own full copy, then rank 0's weights are broadcast);
a resumed run skips it (its state is in the checkpoint), and a task without supervised pairs (a
custom prompt source) skips it with one logged sentence.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from brace_lightning.checks import require_int
from brace_lightning.models.critic import critic_seed
from brace_lightning.seeds import run_seed
from brace_lightning.warmstart import (
    broadcast_from_rank_zero,
    copy_backbone_to_critic,
    supervised_warm_start,
)


class SupervisedWarmStart(pl.Callback):
    """Supervised fine-tuning of the actor on ``(prompt, reference solution)`` pairs at fit start.

    The pairs come from ``trainer.datamodule.task.supervised_pairs(num_pairs)``; a task without
    that method skips the warm start (one info line). Under FSDP2 the actor is trained unsharded
    on every rank before sharding, so it must fit on one device with its AdamW state.

    Args:
        num_pairs: number of pairs drawn from the task.
        steps: optimizer steps.
        batch_size: pairs per step.
        lr: peak learning rate (AdamW, warmup then cosine decay).
        copy_to_critic: re-initialise the critic's backbone from the warm-started actor.
        seed: seed of the pair draw and the batch order (None: the run's ``seed_everything``, see
            ``brace_lightning.seeds``).
    """

    def __init__(
        self,
        *,
        num_pairs: int = 2000,
        steps: int = 300,
        batch_size: int = 64,
        lr: float = 3e-3,
        copy_to_critic: bool = True,
        seed: int | None = None,
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
        self.seed = run_seed(seed)
        self.done = False
        self.final_loss: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Runs before configure_model and before the strategy wraps the module (DDP, FSDP2): the
        # warm start trains the plain actor, never a sharded one or one behind DDP's reducer.
        if stage != "fit" or self.done:
            return
        if trainer.ckpt_path is not None:
            return  # resuming: the warm-started weights and this callback's state are restored
        task = getattr(trainer.datamodule, "task", None)
        if task is None or not hasattr(task, "supervised_pairs"):
            rank_zero_info(
                f"Warm start skipped: the task ({type(task).__name__}) has no supervised_pairs(n)."
            )
            self.done = True
            return
        pairs = task.supervised_pairs(self.num_pairs, seed=self.seed)
        device = trainer.strategy.root_device
        pl_module.actor.to(device)
        pl_module.critic.to(device)
        losses = supervised_warm_start(
            pl_module.actor,
            pl_module.tokenizer,
            pairs,
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            seed=self.seed,
            progress=trainer.is_global_zero and trainer.progress_bar_callback is not None,
        )
        self.final_loss = losses[-1]
        if self.copy_to_critic:
            copy_backbone_to_critic(pl_module.actor, pl_module.critic, seed=critic_seed(self.seed))
        broadcast_from_rank_zero(pl_module.actor, pl_module.critic)
        self.done = True
        if trainer.logger is not None:
            trainer.logger.log_metrics({"warm_start/final_loss": self.final_loss}, step=0)

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "final_loss": self.final_loss}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict["done"])
        self.final_loss = state_dict["final_loss"]
