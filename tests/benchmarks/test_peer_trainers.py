"""benchmarks/peer_trainers.py: the same prompts as our data module, the tables' arithmetic, its
argument errors, and a brief run of every arm (TRL's GRPOTrainer and ours, sync and async)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from benchmarks import peer_trainers
from benchmarks._common import REPO, subprocess_env
from brace_lightning.data import RolloutDataModule
from brace_lightning.rollout import EmbeddedEngine
from brace_lightning.tasks import ArithmeticReward


def test_trls_prompt_stream_is_the_prompts_our_data_module_draws_step_by_step() -> None:
    data = RolloutDataModule(
        task=peer_trainers.quickstart_task(),
        reward=ArithmeticReward(),
        engine=EmbeddedEngine,
        prompts_per_step=3,
        samples_per_prompt=2,
        seed=5,
    )
    ours = [p.text for _ in range(4) for p in data.task.sample(3, data._generator)]
    assert [p.text for p in peer_trainers.prompt_stream(5, 12)] == ours
    assert [p.text for p in peer_trainers.prompt_stream(6, 12)] != ours  # the seed matters


def _run(wall: float, generate: float, reward: list[float], **extra: object) -> dict[str, object]:
    """A run's per-step record: 3 steps of 100 completion tokens (step 1 is slower)."""
    return dict(
        wall=[9.0, wall, wall],
        generate=[5.0, generate, generate],
        score=[1.0, 0.1, 0.1],
        update=[1.0, 0.2, 0.2],
        tokens=[50.0, 100.0, 100.0],
        reward=reward,
        peak_rss_mib=500.0,
        **extra,
    )


def test_the_tables_give_per_seed_ratios_against_trl_the_breakdown_and_the_reward_curve() -> None:
    results = {
        "trl": [_run(1.0, 0.5, [0.1, 0.2, 0.3]), _run(2.0, 1.5, [0.1, 0.4, 0.5])],
        "sync": [_run(0.5, 0.1, [0.2, 0.3, 0.4]), _run(0.5, 0.1, [0.2, 0.3, 0.6])],
        "async1": [_run(0.4, 0.2, [0.2, 0.2, 0.2], trainer_idle=[3.0, 0.05, 0.05])] * 2,
    }
    text = peer_trainers.tables(results, final=2)
    rows: dict[str, str] = {}  # the first table's row of each trainer
    for line in text.splitlines():
        rows.setdefault(line.split(" | ")[0].strip("| "), line)
    trl, sync = rows["TRL GRPOTrainer (sync)"].split(" | "), rows["ours, GRPO (sync)"].split(" | ")
    # Step 1 left out; each column is the median over seeds of the runs' rates: TRL's seeds make
    # 100 tokens in 1 s and 2 s (end to end 100 and 50 tokens/s), generating them in 0.5 and 1.5 s.
    assert trl[1:7] == ["1.500", "100", "133", "333", "75", "1.00x (1.00-1.00)"]
    # ours 0.5 s in both seeds: 2x and 4x TRL's end-to-end tokens/s in the two seeds.
    assert sync[1:7] == ["0.500", "100", "1000", "333", "200", "3.00x (2.00-4.00)"]
    assert sync[8] == "0.400 (0.350-0.450) |"  # mean of the last 2 steps: 0.35 and 0.45
    # async: the trainer's tokens/s and its other time come from the step minus its wait for a batch.
    assert rows["ours, GRPO (async S=1)"].split(" | ")[4] == str(round(100 / 0.35))
    assert "| ours, GRPO (async S=1) | 0.400 | 0.200 | 0.100 | 0.200 | 0.050 |" in text
    assert "| ours, GRPO (sync) | 0.500 | 0.100 | 0.100 | 0.200 | 0.100 |" in text
    assert "| 3 | 0.400 | 0.500 | 0.200 |" in text  # median over seeds per step
    assert len(re.findall(r"^\|---", text, re.MULTILINE)) == 3  # three tables


def test_bad_arguments_are_one_sentence_naming_the_argument(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, message in [
        (
            ["--steps", "1"],
            "argument --steps: expected at least 2 (step 1 is left out of the times)",
        ),
        (["--samples", "1"], "argument --samples: expected at least 2 (a GRPO group); got 1"),
        (["--only", "verl"], "argument --only: invalid choice: 'verl'"),
    ]:
        monkeypatch.setattr("sys.argv", ["peer_trainers", *argv])
        with pytest.raises(SystemExit):
            peer_trainers.main()
        assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (peers)")
def test_a_brief_run_of_every_arm_prints_the_three_tables(tmp_path) -> None:
    args = ["--steps", "2", "--seeds", "1", "--prompts", "2", "--samples", "2", "--tokens", "8"]
    args += ["--warm-start-steps", "2", "--out", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer_trainers", *args],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    ).stdout
    assert "2 rollout steps x 2 prompts x 2 samples (at most 8 new tokens)" in out
    for label in peer_trainers.ARMS.values():
        assert len(re.findall(rf"^\| {re.escape(label)} \|", out, re.MULTILINE)) == 2, label
    (trl,) = re.findall(r"^\| TRL GRPOTrainer \(sync\) \| ([\d.]+) \|.*", out, re.MULTILINE)[:1]
    assert float(trl) > 0
    assert "| 1.00x (1.00-1.00) |" in out
    assert re.search(
        r"^\| 2 \| [01]\.\d{3} \| [01]\.\d{3} \| [01]\.\d{3} \| [01]\.\d{3} \|$", out, re.M
    )
    assert (tmp_path / "warm_start" / "actor" / "config.json").exists()
