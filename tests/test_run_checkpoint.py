"""Every run's checkpoint (``callbacks.RunCheckpoint``, the CLI's ``--checkpoint.*``): ``last.ckpt``
every ``every_n_train_steps`` rollout steps and when the run fails; ``fit --ckpt_path last`` resumes
in the same log folder; ``--trainer.default_root_dir`` moves logs and checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml

from brace_lightning.callbacks import RunCheckpoint
from brace_lightning.cli import run
from brace_lightning.logs import read_scalars
from tests.test_trainer import small_run


def versions(tmp_path: Path) -> list[str]:
    """Every log folder under ``tmp_path`` (any name, any version)."""
    return sorted(path.name for path in tmp_path.rglob("version_*") if path.is_dir())


def saved_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["brace"]["rollout_step"])


class FailAt(pl.Callback):
    """Raises before rollout step ``step + 1`` (stands for a crash mid-run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


def test_a_run_saves_every_n_rollout_steps_and_a_finished_run_resumes_to_nothing(
    tmp_path: Path,
) -> None:
    periodic = ["--checkpoint.every_n_train_steps=2", "--checkpoint.save_top_k=-1"]
    first = run(small_run(tmp_path, *periodic, steps=5))
    (checkpoint,) = [c for c in first.trainer.callbacks if isinstance(c, RunCheckpoint)]
    folder = Path(first.trainer.logger.log_dir) / "checkpoints"
    assert Path(checkpoint.dirpath) == folder
    names = ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert sorted(p.name for p in folder.iterdir()) == names
    assert saved_step(folder / "last.ckpt") == 5  # saved again at the end, between two periods
    again = run(small_run(tmp_path, *periodic, "--ckpt_path=last", steps=5))
    assert again.model.rollout_step == 5 and versions(tmp_path) == ["version_0"]


def test_a_crashed_run_leaves_last_ckpt_and_ckpt_path_last_resumes_it(tmp_path: Path) -> None:
    periodic = ["--checkpoint.every_n_train_steps=2"]
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(small_run(tmp_path, *periodic, steps=4), trainer_defaults={"callbacks": [FailAt(3)]})
    (last,) = tmp_path.glob("quickstart/*/version_0/checkpoints/last.ckpt")
    assert saved_step(last) == 3  # periodic at step 2, then on the exception
    resumed = run(small_run(tmp_path, *periodic, "--ckpt_path=last", steps=4))
    assert resumed.model.rollout_step == 4 and resumed.trainer.global_step == 4
    assert versions(tmp_path) == ["version_0"]  # logged on in the checkpoint's folder
    rewards = read_scalars(resumed.trainer.logger.log_dir)["rollout/reward"]
    assert [step for step, _ in rewards] == [1, 2, 3, 4]


def test_recipe_callbacks_leave_the_run_checkpoint_and_enable_checkpointing_removes_it(
    tmp_path: Path,
) -> None:
    # small_run drops the recipe's callbacks (--trainer.callbacks=[]): the checkpoint stays.
    kept = run(small_run(tmp_path / "kept", steps=1))
    assert any(isinstance(c, RunCheckpoint) for c in kept.trainer.callbacks)
    assert list((tmp_path / "kept").glob("quickstart/*/version_0/checkpoints/last.ckpt"))
    off = run(small_run(tmp_path / "off", "--trainer.enable_checkpointing=false", steps=1))
    assert not any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in off.trainer.callbacks)
    assert not list((tmp_path / "off").rglob("*.ckpt"))


def test_default_root_dir_moves_the_recipes_logs_and_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = [a for a in small_run(tmp_path, steps=1) if "save_dir" not in a and "root_dir" not in a]
    cli = run([*args, "--trainer.default_root_dir=out", "--checkpoint.dirpath=ckpt"])
    assert Path(cli.trainer.logger.log_dir).resolve().is_relative_to(tmp_path / "out" / "runs")
    assert (tmp_path / "out" / "ckpt" / "last.ckpt").exists()
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ckpt").exists()


def test_every_recipe_saves_periodically() -> None:
    """Each whole recipe (not an overlay) sets the run checkpoint's interval and keeps it on."""
    from tests.test_configs import RECIPES

    assert RECIPES
    for path in RECIPES:
        recipe = yaml.safe_load(path.read_text())
        interval = (recipe.get("checkpoint") or {}).get("every_n_train_steps")
        assert isinstance(interval, int) and interval >= 1, path
        assert (recipe.get("trainer") or {}).get("enable_checkpointing") is not False, path
