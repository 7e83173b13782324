"""Lightning's step counting in rollout steps: ``trainer.global_step`` advances once per rollout
step (``optim.one_global_step``), so ``max_steps``, ``every_n_train_steps`` and schedulers'
periods count rollout steps, not the ppo_epochs × num_minibatches × 2 optimizer steps inside one."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from brace_lightning.cli import run
from tests.test_trainer import small_run

#: Two PPO epochs of two minibatches: 8 optimizer steps per rollout step.
UPDATES = ["--model.ppo_epochs=2", "--model.num_minibatches=2"]


class StepLog(pl.Callback):
    """After every rollout step: (rollout step, global step, actor lr, critic lr)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, float, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        actor, critic = module.optimizers()
        lrs = actor.param_groups[0]["lr"], critic.param_groups[0]["lr"]
        self.rows.append((module.rollout_step, trainer.global_step, *lrs))


def test_max_steps_counts_rollout_steps(tmp_path: Path) -> None:
    log = StepLog()
    cli = run(
        small_run(tmp_path, *UPDATES, "--trainer.max_steps=3", steps=10),
        trainer_defaults={"callbacks": [log]},
    )
    assert cli.model.rollout_step == 3 and cli.trainer.global_step == 3
    assert [(rollout, step) for rollout, step, _, _ in log.rows] == [(1, 1), (2, 2), (3, 3)]


def test_every_n_train_steps_saves_after_every_second_rollout_step(tmp_path: Path) -> None:
    save = [
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
        "--trainer.callbacks.every_n_train_steps=2",
        "--trainer.callbacks.save_top_k=-1",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(small_run(tmp_path, *UPDATES, *save, steps=5))
    # Lightning's 13-line note that the state is saved after the update is left out (console.py).
    assert not [w for w in caught if "manual optimization and every_n" in str(w.message)]
    names = sorted(path.name for path in (tmp_path / "ckpt").iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]


def test_a_cosine_schedule_reaches_its_minimum_at_rollout_step_t_max(tmp_path: Path) -> None:
    cosine = "torch.optim.lr_scheduler.CosineAnnealingLR"
    schedules = [
        f"--model.actor_scheduler={cosine}",
        "--model.actor_scheduler.T_max=4",
        f"--model.critic_scheduler={cosine}",
        "--model.critic_scheduler.T_max=4",
        "--model.critic_scheduler.eta_min=0.0001",
    ]
    log = StepLog()
    run(small_run(tmp_path, *UPDATES, *schedules, steps=6), trainer_defaults={"callbacks": [log]})
    actor_lr, critic_lr = 1e-4, 1e-3  # configs/quickstart.yaml
    for rollout, _, actor, critic in log.rows:
        cosine_factor = (1 + math.cos(math.pi * rollout / 4)) / 2
        assert actor == pytest.approx(actor_lr * cosine_factor, abs=1e-12), rollout
        assert critic == pytest.approx(1e-4 + (critic_lr - 1e-4) * cosine_factor), rollout
    assert log.rows[3][2] == pytest.approx(0.0, abs=1e-12)  # minimum at rollout step 4
    assert log.rows[3][3] == pytest.approx(1e-4)
