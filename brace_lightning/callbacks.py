"""Lightning callbacks of the trainer.

:class:`SupervisedWarmStart` fine-tunes the actor on the task's reference solutions before the first
rollout, so a tiny randomly initialised model starts RL with a non-zero reward (the quickstart
recipe). It runs once, in ``setup`` before the strategy shards or wraps the model (so it works the
same under DDP and FSDP2: every rank trains its own full copy, then rank 0's weights are broadcast);
a resumed run skips it (its state is in the checkpoint), and a task without supervised pairs (a
custom prompt source) skips it with one logged sentence.

:class:`CollapseWarning` watches three signals of a collapsing asynchronous run (issue 30,
``docs/stability.md``) and, when one stays past its threshold for ``patience`` rollout steps in a
row, logs one line that names what happened and what to try; optionally it stops the run.

:class:`RunCheckpoint` is the checkpoint every run gets (the CLI's ``checkpoint`` options): Lightning's
``ModelCheckpoint`` saving ``last.ckpt`` every ``every_n_train_steps`` rollout steps, at the end, and
when the run fails (``save_on_exception``), so ``fit --ckpt_path last`` resumes a run that crashed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from brace_lightning.checks import require_bool, require_int
from brace_lightning.models.critic import critic_seed
from brace_lightning.seeds import run_seed
from brace_lightning.warmstart import (
    broadcast_from_rank_zero,
    copy_backbone_to_critic,
    supervised_warm_start,
)

logger = logging.getLogger(__name__)


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
        critic = pl_module.critic  # None with a critic-free value target
        pl_module.actor.to(device)
        if critic is not None:
            critic.to(device)
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
        if self.copy_to_critic and critic is not None:
            copy_backbone_to_critic(pl_module.actor, critic, seed=critic_seed(self.seed))
        broadcast_from_rank_zero(*(m for m in (pl_module.actor, critic) if m is not None))
        self.done = True
        if trainer.logger is not None:
            trainer.logger.log_metrics({"warm_start/final_loss": self.final_loss}, step=0)

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "final_loss": self.final_loss}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict["done"])
        self.final_loss = state_dict["final_loss"]


@dataclass(frozen=True)
class CollapseSignal:
    """One watched metric: its logged ``key``, what staying above the threshold means and what to
    try (the two halves of the warning line)."""

    key: str
    what: str
    advice: str


#: The signals :class:`CollapseWarning` watches, by the name of its threshold argument.
COLLAPSE_SIGNALS = {
    "kl_threshold": CollapseSignal(
        "kl/mu_pi_k3",
        "the k3 KL(µ‖π) per token between the engine's samples and the trainer's policy",
        "lower the actor's lr or max_staleness (lag × lr sets the drift), or truncate the "
        "behaviour weight (DecoupledPPO weight_cap)",
    ),
    "length_cap_threshold": CollapseSignal(
        "rollout/length_capped_fraction",
        "the fraction of responses cut at max_new_tokens (scored as failures)",
        "lower the actor's lr, or raise the engine's max_new_tokens if the task needs longer "
        "answers",
    ),
    "equal_reward_threshold": CollapseSignal(
        "rollout/equal_reward_group_fraction",
        "the fraction of prompt groups whose rewards are all equal (all 0: a collapsed policy; "
        "all 1: a solved task)",
        "check rollout/reward; if it is 0, resume from an earlier checkpoint with a lower actor "
        "lr or max_staleness, and keep skip_equal_reward_batches on",
    ),
}


def next_run(run: int, value: float, threshold: float) -> int:
    """The number of consecutive steps past ``threshold`` after one more step at ``value``, from
    ``run`` before it: :class:`CollapseWarning` warns when it reaches its ``patience``."""
    return run + 1 if value > threshold else 0


def warning_positions(values: Sequence[float], threshold: float, patience: int) -> list[int]:
    """The 0-based positions in ``values`` (one signal's logged values, in step order) at which
    :class:`CollapseWarning` with this ``threshold`` and ``patience`` would warn: replays its rule
    on a recorded run."""
    positions, run = [], 0
    for position, value in enumerate(values):
        run = next_run(run, value, threshold)
        if run == patience:
            positions.append(position)
    return positions


class CollapseWarning(pl.Callback):
    """One warning line when a collapse signal stays past its threshold for ``patience`` steps.

    After every rollout step it reads the logged metrics (``trainer.callback_metrics``): the k3
    KL(µ‖π) per token (``kl/mu_pi_k3``), the length-capped fraction of responses
    (``rollout/length_capped_fraction``) and the fraction of prompt groups whose rewards are all
    equal (``rollout/equal_reward_group_fraction``). A signal above its threshold for ``patience``
    consecutive steps logs one line (global rank 0) naming the signal, its value and threshold, and
    what to try; it warns again only after it has dropped back to the threshold or below. A step
    that did not log a signal leaves its run of steps unchanged.

    Args:
        kl_threshold: k3 KL(µ‖π) per token above which a step counts (None: not watched). In
            issue 30's collapsed lag-8 runs of the counting recipe it was 0.03–0.09; at half the
            learning rate, where the run did not collapse, ten times lower.
        length_cap_threshold: fraction of responses cut at max_new_tokens above which a step counts
            (None: not watched).
        equal_reward_threshold: fraction of equal-reward prompt groups above which a step counts
            (None: not watched).
        patience: consecutive steps past a threshold before the warning.
        stop: also stop the run (``trainer.should_stop``) when a warning is logged.
    """

    def __init__(
        self,
        *,
        kl_threshold: float | None = 0.02,
        length_cap_threshold: float | None = 0.5,
        equal_reward_threshold: float | None = 0.9,
        patience: int = 20,
        stop: bool = False,
    ) -> None:
        thresholds = {
            "kl_threshold": kl_threshold,
            "length_cap_threshold": length_cap_threshold,
            "equal_reward_threshold": equal_reward_threshold,
        }
        for name, value in thresholds.items():
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0.0 <= value < math.inf
            ):
                raise ValueError(f"{name} must be None or a finite number >= 0; got {value!r}.")
        require_int("patience", patience, 1)
        require_bool("stop", stop)
        self.thresholds = {n: float(v) for n, v in thresholds.items() if v is not None}
        self.patience = patience
        self.stop = stop
        self.runs = dict.fromkeys(self.thresholds, 0)  # consecutive steps past each threshold
        self.warnings: list[str] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        metrics = trainer.callback_metrics
        for name, threshold in self.thresholds.items():
            signal = COLLAPSE_SIGNALS[name]
            if signal.key not in metrics:
                continue
            value = float(metrics[signal.key])
            self.runs[name] = next_run(self.runs[name], value, threshold)
            if self.runs[name] != self.patience:
                continue
            step = int(metrics["step"]) if "step" in metrics else trainer.global_step
            line = (
                f"Possible collapse at rollout step {step}: {signal.what} ({signal.key}) has "
                f"stayed above {threshold:g} for {self.patience} steps (now {value:.3g}); try: "
                f"{signal.advice}."
                + (" Stopping (CollapseWarning stop=True)." if self.stop else "")
            )
            self.warnings.append(line)
            if trainer.is_global_zero:
                logger.warning(line)
            if self.stop:
                trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"runs": dict(self.runs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.runs.update({k: v for k, v in state_dict["runs"].items() if k in self.runs})


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` with a run's defaults: periodic, last and on failure.

    ``trainer.global_step`` counts rollout steps (``optim.one_global_step``), so
    ``every_n_train_steps`` is in rollout steps. By default only ``last.ckpt`` is kept (``save_top_k``
    0: a 1.5B model's checkpoint with optimizer states is tens of GB); ``save_top_k=-1`` keeps every
    periodic one as ``epoch=E-step=S.ckpt``. The folder is Lightning's: ``<log_dir>/checkpoints``,
    or ``<default_root_dir>/checkpoints`` without a logger.

    Args:
        dirpath: the checkpoints' folder (None: Lightning's, above).
        every_n_train_steps: save every this many rollout steps (None or 0: only at the end).
        save_last: keep ``last.ckpt`` (what ``fit --ckpt_path last`` resumes).
        save_top_k: periodic checkpoints kept besides ``last.ckpt`` (-1: all; with ``monitor``, the best).
        monitor: a logged metric that ranks the kept checkpoints (e.g. ``rollout/reward``).
        mode: ``"min"`` or ``"max"`` for ``monitor``.
        save_on_exception: save when the run fails, in single-process runs only (with several
            processes the save is collective and would wait for the ranks that did not fail).
    """

    def __init__(
        self,
        *,
        dirpath: str | None = None,
        every_n_train_steps: int | None = 50,
        save_last: bool = True,
        save_top_k: int = 0,
        monitor: str | None = None,
        mode: str = "min",
        save_on_exception: bool = True,
    ) -> None:
        super().__init__(
            dirpath=dirpath,
            every_n_train_steps=every_n_train_steps or 0,
            save_last=save_last,
            save_top_k=save_top_k,
            monitor=monitor,
            mode=mode,
            save_on_exception=save_on_exception,
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save ``last.ckpt`` at the end unless the last periodic save was at this very step
        (Lightning's own end-of-run save is skipped once any periodic one happened, so a run
        stopped between two saves would resume from the older one)."""
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        else:
            super().on_train_end(trainer, pl_module)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if trainer.world_size == 1:
            super().on_exception(trainer, pl_module, exception)
