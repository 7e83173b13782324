"""What a run prints: no Lightning tips, no warnings the project causes, no ``v_num`` in the bar,
and vLLM at warning level without the warnings that follow from how the engines run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from brace_lightning.console import rollout_progress_bar
from brace_lightning.rollout.vllm import EXPECTED_VLLM_WARNINGS

REPO = Path(__file__).resolve().parents[1]
#: How Python prints a warning: ``path.py:LINE: Category: message`` (or without the category).
WARNING_LINE = re.compile(r"\.py:\d+: ")


def console(tmp_path: Path, *args: str) -> str:
    """Everything ``brace-lightning fit`` prints (stdout and stderr) for ``args``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("VLLM_LOGGING_LEVEL", None)
    done = subprocess.run(
        [sys.executable, "-m", "brace_lightning.cli", "fit", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.slow
def test_a_quickstart_run_prints_no_tips_and_no_warnings(tmp_path: Path) -> None:
    out = console(
        tmp_path,
        "--config",
        str(REPO / "configs/quickstart.yaml"),
        "--trainer.limit_train_batches=2",
        "--trainer.logger.init_args.save_dir=runs",
        "--data.prompts_per_step=2",
    )
    assert "Tip:" not in out
    assert not [line for line in out.splitlines() if WARNING_LINE.search(line)], out[-3000:]
    assert "Warm start: 100%" in out  # the warm start shows its progress
    assert "reward" in out and "stale" in out and "v_num" not in out  # the bar's metrics


def test_the_silenced_warnings_are_exactly_the_named_ones() -> None:
    import warnings

    from brace_lightning.console import silence_harmless_warnings

    messages = [
        "You are using the `dataloader_iter` step flavor. Here be dragons.",
        "Found `dataloader_iter` argument in the `training_step`. Note ...",
        "`isinstance(treespec, LeafSpec)` is deprecated, use ...",
        "any other warning about dataloader_iter",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_harmless_warnings()  # inside the "always" context the named ones are ignored again
        for message in messages:
            warnings.warn(message, FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == messages[-1:]


def test_the_progress_bar_drops_only_the_version() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

    bar = rollout_progress_bar()
    logger = SimpleNamespace(version=7)
    trainer = SimpleNamespace(loggers=[logger], progress_bar_metrics={"reward": 0.5, "kl": 0.1})
    assert ProgressBar.get_metrics(bar, trainer, None)["v_num"] == 7  # Lightning's own bar
    assert bar.get_metrics(trainer, None) == {"reward": 0.5, "kl": 0.1}


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_runs_at_warning_level_without_the_expected_warnings(tmp_path: Path) -> None:
    from tests.support.vllm_support import require_vllm

    require_vllm()
    out = console(
        tmp_path,
        "--config",
        str(REPO / "configs/quickstart.yaml"),
        "--config",
        str(REPO / "configs/vllm.yaml"),
        "--trainer.callbacks=[]",
        "--trainer.limit_train_batches=2",
        "--trainer.logger.init_args.save_dir=runs",
        "--trainer.enable_progress_bar=false",
        "--model.critic_warmup_steps=0",
        "--data.prompts_per_step=2",
    )
    vllm_lines = [line for line in out.splitlines() if "(MainProcess pid=" in line]
    assert not [line for line in vllm_lines if " INFO " in line], vllm_lines
    for messages in EXPECTED_VLLM_WARNINGS.values():
        for message in messages:
            assert message not in out, message


def test_python_api_users_get_no_tips_either(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    import lightning.pytorch as pl

    from brace_lightning import console
    from brace_lightning.module import BraceModule

    for name in console.LIGHTNING_RANK_ZERO_LOGGERS:  # as in a fresh process (the CLI may have run)
        logging.getLogger(name).removeFilter(console._DROP_TIPS)
    # built before the trainer, as in the tutorials
    BraceModule(tiny_hidden_size=32, tiny_num_layers=1)
    with caplog.at_level(logging.INFO):
        pl.Trainer(
            accelerator="cpu",
            logger=pl.loggers.TensorBoardLogger(tmp_path),
            enable_progress_bar=False,
        )
    assert any("GPU available" in record.getMessage() for record in caplog.records)
    assert not [r for r in caplog.records if r.getMessage().startswith("💡 Tip:")]
