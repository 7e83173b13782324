"""Step metrics go through ``self.log_dict``: callbacks that monitor them work, TensorBoard stays
indexed by rollout step, and no metric is logged twice under two names."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from brace_lightning.cli import run
from brace_lightning.logs import read_scalars
from tests.test_trainer import small_run


@pytest.mark.slow
def test_checkpoint_monitor_and_early_stopping_see_the_logged_metrics(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    cli = run(
        small_run(
            tmp_path,
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={ckpt}",
            "--trainer.callbacks.monitor=rollout/reward",
            "--trainer.callbacks.mode=max",
            "--trainer.callbacks.save_top_k=1",
            "--trainer.callbacks.every_n_train_steps=1",
            "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping",
            "--trainer.callbacks.monitor=critic/loss",
            "--trainer.callbacks.check_on_train_epoch_end=true",
            "--trainer.callbacks.patience=100",
            steps=3,
        )
    )
    checkpoint, stopper = cli.trainer.checkpoint_callback, cli.trainer.early_stopping_callback
    assert checkpoint.best_model_score is not None and len(list(ckpt.iterdir())) == 1
    assert "rollout/reward" in cli.trainer.callback_metrics
    assert stopper.best_score.isfinite()  # EarlyStopping found critic/loss every step
    scalars = read_scalars(cli.trainer.logger.log_dir)
    # x-axis = rollout step, every step; the "step" key sets it and is not a scalar of its own
    for name in ("rollout/reward", "critic/loss", "kl/mu_pi_k3", "data/staleness_mean"):
        assert [step for step, _ in scalars[name]] == [1, 2, 3], name
    assert "step" not in scalars and "epoch" not in scalars
    for duplicate in ("data/mean_score", "data/accuracy", "data/mean_response_length"):
        assert duplicate not in scalars
    new = [
        "rollout/score_std", "rollout/score_min", "rollout/score_max",
        "rollout/advantage_mean", "rollout/advantage_std", "rollout/advantage_min",
        "rollout/advantage_max", "rollout/entropy", "rollout/prompt_length",
        "rollout/response_length_max", "lr/actor", "lr/critic", "memory/max_rss_gb",
        "time/old_forward_ms", "time/update_ms", "time/weight_sync_ms", "time/value_target_ms",
        "perf/update_tokens_per_s", "data/gen_tokens_per_s", "data/generate_s",
    ]  # fmt: skip
    for name in new:
        assert [step for step, _ in scalars[name]] == [1, 2, 3], name
    # tokens/s of the previous batch, trainer-side and end to end (none for the first batch)
    for name in ("data/train_tokens_per_s", "data/tokens_per_s"):
        assert [step for step, _ in scalars[name]] == [2, 3], name
    last = {name: points[-1][1] for name, points in scalars.items()}
    assert last["data/train_tokens_per_s"] > last["data/tokens_per_s"] > 0  # generation adds time
    assert last["lr/actor"] == pytest.approx(1e-4) and last["lr/critic"] == pytest.approx(1e-3)
    assert last["rollout/score_min"] <= last["rollout/reward"] <= last["rollout/score_max"]
    assert last["rollout/advantage_min"] <= last["rollout/advantage_max"]
    assert last["rollout/entropy"] > 0 and last["memory/max_rss_gb"] > 0.1
    assert last["rollout/prompt_length"] >= 4  # "d+d=" at least
    assert last["time/update_ms"] > 0 and last["perf/update_tokens_per_s"] > 0
    # a few sample completions as text at step 1
    events = EventAccumulator(cli.trainer.logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    (sample,) = events.Tensors("samples/completions/text_summary")
    assert sample.step == 1 and b"score" in sample.tensor_proto.string_val[0]
    # the best checkpoint's score is the best logged reward
    assert float(checkpoint.best_model_score) == pytest.approx(
        max(value for _, value in scalars["rollout/reward"])
    )
