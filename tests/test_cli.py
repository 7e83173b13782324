"""The CLI offers only what works: fit and validate, --version, data modules by short name, no
LightningCLI --optimizer/--lr_scheduler (optimizers are model arguments); runs named by what
differs."""

from __future__ import annotations

import pytest
import yaml
from jsonargparse import Namespace, dict_to_namespace

import brace_lightning
from brace_lightning.cli import run
from brace_lightning.run_names import name_tensorboard_run, run_name
from tests.test_trainer import CONFIGS


def _exit(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        run(args)
    captured = capsys.readouterr()
    return int(stop.value.code or 0), captured.out + captured.err


def test_version_subcommands_and_optimizer_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _exit(["--version"], capsys)
    assert code == 0 and out.strip() == f"brace-lightning {brace_lightning.__version__}"

    code, out = _exit(["--help"], capsys)
    assert code == 0 and "{fit,validate,test}" in out
    for gone in ("predict",):
        code, out = _exit([gone], capsys)
        assert code == 2 and "invalid choice" in out.lower(), out

    code, out = _exit(["fit", "--help"], capsys)
    assert "--data.help RolloutDataModule" in out and "max_staleness" in out
    assert "--optimizer" not in out and "--lr_scheduler" not in out
    code, out = _exit(
        ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--optimizer", "SGD"], capsys
    )
    assert code == 2 and "--optimizer" in out


def test_data_modules_by_short_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _exit(["fit", "--data.help", "AsyncRolloutDataModule"], capsys)
    assert code == 0 and "--data.max_staleness" in out and "--data.prompts_per_step" in out
    code, out = _exit(
        [
            "fit",
            "--config",
            str(CONFIGS / "quickstart.yaml"),
            "--data",
            "AsyncRolloutDataModule",
            "--data.max_staleness",
            "3",
            "--print_config",
        ],
        capsys,
    )
    assert code == 0, out
    data = yaml.safe_load(out)["data"]
    assert data["class_path"] == "brace_lightning.data.AsyncRolloutDataModule"
    assert data["init_args"]["max_staleness"] == 3


def _config(**data_args: object) -> Namespace:
    return dict_to_namespace(
        {
            "trainer": {
                "logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs", "name": "quickstart", "version": None},
                }
            },
            "model": {
                "value_target": {"class_path": "brace_lightning.targets.GAE", "init_args": {}},
                "actor_objective": {"class_path": "brace_lightning.objectives.TIS"},
            },
            "data": {
                "class_path": data_args.pop("class_path", "brace_lightning.data.RolloutDataModule"),
                "init_args": {
                    "task": {"class_path": "brace_lightning.tasks.ArithmeticTask"},
                    **data_args,
                },
            },
        }
    )


def test_runs_are_named_by_task_target_objective_and_staleness() -> None:
    config = _config(lag=1)
    name_tensorboard_run(config)
    assert config.trainer.logger.init_args.name == "quickstart/ArithmeticTask-GAE-TIS-lag1"
    config = _config(class_path="brace_lightning.data.AsyncRolloutDataModule", max_staleness=4)
    assert run_name(config) == "ArithmeticTask-GAE-TIS-stale4"
    config = _config(lag=1)
    config.trainer.logger.init_args.version = "mine"  # an explicit version is left alone
    name_tensorboard_run(config)
    assert config.trainer.logger.init_args.name == "quickstart"
