"""The CLI offers only what works: fit and validate, --version, data modules by short name, no
LightningCLI --optimizer/--lr_scheduler (optimizers are model arguments)."""

from __future__ import annotations

import pytest
import yaml

import brace_lightning
from brace_lightning.cli import run
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
    assert code == 0 and "{fit,validate}" in out
    for gone in ("test", "predict"):
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
