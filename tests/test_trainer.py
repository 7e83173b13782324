"""End-to-end trainer runs on the tiny model: CLI per value target, accumulation, resume, errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from brace_lightning.cli import run
from brace_lightning.logs import read_scalars
from brace_lightning.module import BraceModule
from brace_lightning.tasks import Prompt, RewardFunction

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def small_run(tmp_path: Path, *extra: str, steps: int = 2) -> list[str]:
    """CLI args for a few fast rollout steps of the quickstart recipe, without the warm start."""
    return [
        "fit",
        "--config",
        str(CONFIGS / "quickstart.yaml"),
        "--trainer.callbacks=[]",
        f"--trainer.limit_train_batches={steps}",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--model.tiny_hidden_size=64",
        "--model.tiny_num_layers=1",
        "--model.critic_warmup_steps=0",
        "--data.prompts_per_step=4",
        "--data.samples_per_prompt=2",
        "--data.engine.init_args.max_new_tokens=12",
        # An untrained tiny model earns reward 0 everywhere: keep the actor's path under test.
        "--model.skip_equal_reward_batches=false",
        *extra,
    ]


def stop_and_checkpoint_at(dirpath: Path, rollout_step: int) -> list[str]:
    """CLI args that stop the run after ``rollout_step`` rollout steps (``trainer.global_step``
    counts rollout steps) and save a checkpoint there."""
    return [
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={dirpath}",
        f"--trainer.callbacks.every_n_train_steps={rollout_step}",
        "--trainer.callbacks.save_top_k=-1",
        f"--trainer.max_steps={rollout_step}",
    ]


def actor_weights(cli) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.actor.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("target", ["gae", "vtrace", "brace"])
def test_cli_fit_with_each_value_target_logs_to_tensorboard(tmp_path, target):
    cli = run(small_run(tmp_path, "--config", str(CONFIGS / "targets" / f"{target}.yaml")))
    assert type(cli.model.value_target).__name__.lower() == target
    assert cli.model.rollout_step == 2
    scalars = read_scalars(cli.trainer.logger.log_dir)
    for name in (
        "rollout/reward",
        "critic/loss",
        "actor/loss",
        "data/staleness_mean",
        "time/value_target_ms",
    ):
        assert [step for step, _ in scalars[name]] == [1, 2], name


@pytest.mark.slow
def test_bf16_mixed_precision_trains_with_finite_losses(tmp_path):
    cli = run(small_run(tmp_path, "--trainer.precision=bf16-mixed"))
    assert cli.trainer.precision == "bf16-mixed"
    scalars = read_scalars(cli.trainer.logger.log_dir)
    for name in ("actor/loss", "critic/loss"):
        assert len(scalars[name]) == 2
        assert all(torch.isfinite(torch.tensor(value)) for _, value in scalars[name]), name


@pytest.mark.slow
def test_explained_variance_is_nan_without_target_spread_and_versions_are_logged(tmp_path):
    gae = ["--config", str(CONFIGS / "targets" / "gae.yaml")]
    flat = read_scalars(
        run(
            small_run(tmp_path / "flat", *gae, "--data.reward=tests.test_trainer.ConstantReward")
        ).trainer.logger.log_dir
    )
    assert all(math.isnan(value) for _, value in flat["critic/explained_variance"])
    spread = read_scalars(
        run(
            small_run(tmp_path / "spread", *gae, "--data.reward=tests.test_trainer.ParityReward")
        ).trainer.logger.log_dir
    )
    assert all(math.isfinite(v) and v <= 1.0 for _, v in spread["critic/explained_variance"])
    # the trainer's version when each batch was consumed: 0 before the first update, then 1
    assert [value for _, value in spread["data/trainer_version"]] == [0.0, 1.0]
    # generation time and throughput of every rollout batch, as the async producer logs them
    assert all(value > 0 for _, value in spread["data/generate_s"])
    assert all(value > 0 for _, value in spread["data/gen_tokens_per_s"])


@pytest.mark.slow
def test_validate_scores_on_policy_rollouts_and_fit_logs_them_at_the_rollout_step(tmp_path):
    parity = ["--data.reward=tests.test_trainer.ParityReward", "--data.val_batches=2"]
    cli = run(["validate", *small_run(tmp_path / "validate", *parity)[1:]])
    results = cli.trainer.callback_metrics
    scores = ("val/value_mse_mc", "val/value_abs_error_mc", "val/value_bias_mc")
    for name in ("val/reward", "val/accuracy", "val/response_length", *scores):
        assert name in results, name
    assert "val/value_bias_pos0_8" in results and "val/value_gap_mc" not in results
    assert 0.0 < float(results["val/reward"]) < 1.0  # parity of random lengths
    assert float(results["val/value_mse_mc"]) > 0.0  # an untrained critic is off

    fitted = run(small_run(tmp_path / "fit", *parity))
    scalars = read_scalars(fitted.trainer.logger.log_dir)
    assert [step for step, _ in scalars["val/reward"]] == [
        2
    ]  # after the epoch, not the sanity check
    # the same fixed prompts every pass: validating the fitted model again gives its val/reward
    fitted.trainer.validate(fitted.model, datamodule=fitted.datamodule)
    again = float(fitted.trainer.callback_metrics["val/reward"])
    assert again == pytest.approx(scalars["val/reward"][0][1])
    without = read_scalars(run(small_run(tmp_path / "none")).trainer.logger.log_dir)
    assert not [name for name in without if name.startswith("val/")]


@pytest.mark.slow
def test_beta_is_logged_every_step_and_is_one_for_the_undiscounted_gae_return(tmp_path):
    """GAE with γ = λ = 1 regresses the realized return itself, so β = 1 in every horizon bin;
    a stale BRACE target (lag 2, values that are not the return) has a different slope."""
    parity = ["--data.reward=tests.test_trainer.ParityReward", "--data.samples_per_prompt=4"]
    gae = read_scalars(
        run(
            small_run(tmp_path / "gae", *parity, "--config", str(CONFIGS / "targets" / "gae.yaml"))
        ).trainer.logger.log_dir
    )
    bins = [name for name in gae if name.startswith("critic/beta_by_horizon/")]
    assert bins and [step for step, _ in gae["critic/beta"]] == [1, 2]
    for name in [*bins, "critic/beta"]:
        assert all(abs(value - 1.0) < 1e-4 for _, value in gae[name]), name
    brace = read_scalars(
        run(small_run(tmp_path / "brace", *parity, "--data.lag=2")).trainer.logger.log_dir
    )
    assert any(abs(value - 1.0) > 1e-3 for _, value in brace["critic/beta"])


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    whole = run(small_run(tmp_path / "a", "--data.lag=0", steps=1))
    micro = run(small_run(tmp_path / "b", "--data.lag=0", "--model.micro_batch_size=3", steps=1))
    a, b = actor_weights(whole), actor_weights(micro)
    initial = BraceModule(tiny_hidden_size=64, tiny_num_layers=1).actor.state_dict()
    assert any(not torch.equal(a[name], initial[name]) for name in a), "the step changed nothing"
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    ca, cb = whole.model.critic.state_dict(), micro.model.critic.state_dict()
    for name in ca:
        torch.testing.assert_close(ca[name], cb[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("lag", [0, 2])
def test_resume_from_a_mid_run_checkpoint_is_exact(tmp_path, lag):
    common = [
        "--data.lag",
        str(lag),
        "--model.critic_warmup_steps=1",
        "--model.ppo_epochs=1",
        "--trainer.limit_train_batches=4",
    ]
    straight = run(small_run(tmp_path / "straight", *common, steps=4))
    save = stop_and_checkpoint_at(tmp_path / "ckpt", 3)
    first = run(small_run(tmp_path / "first", *common, *save, steps=4))
    assert first.model.rollout_step == 3
    # Saved and named at rollout step 3 (global_step and the TensorBoard x-axis).
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert [path.name for path in (tmp_path / "ckpt").iterdir()] == [checkpoint.name]
    resumed = run(small_run(tmp_path / "resumed", *common, f"--ckpt_path={checkpoint}", steps=4))
    assert (
        resumed.model.rollout_step == 4
        and resumed.model.policy_version == straight.model.policy_version
    )
    a, b = actor_weights(straight), actor_weights(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    dm_a, dm_b = straight.datamodule, resumed.datamodule
    assert dm_a.counters == dm_b.counters
    assert (
        dm_a.counters["generated"]
        == dm_a.counters["trained"]
        + dm_a.counters["dropped_stale"]
        + dm_a.counters["dropped_reward_error"]
        + dm_a.counters["dropped_empty"]
    )


class FailingReward(RewardFunction):
    """A verifier that always raises (stands for a broken user reward function)."""

    def __call__(self, prompt: Prompt, completion: str) -> float:
        raise RuntimeError("verifier crashed")


class ParityReward(RewardFunction):
    """Scores 1 for completions of even length, else 0 (a reward with spread from a random model)."""

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return float(len(completion) % 2 == 0)


class ConstantReward(RewardFunction):
    """Scores every completion 1 (targets without spread)."""

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0


class HalfFailingReward(RewardFunction):
    """Raises on completions of odd length, otherwise scores 1 (a verifier with a bug)."""

    def __call__(self, prompt: Prompt, completion: str) -> float:
        if len(completion) % 2:
            raise RuntimeError("verifier crashed")
        return 1.0

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        return True


@pytest.mark.slow
def test_a_failing_reward_drops_samples_and_counts_them(tmp_path):
    cli = run(small_run(tmp_path, "--data.reward=tests.test_trainer.HalfFailingReward"))
    counts = cli.datamodule.counters
    assert counts["dropped_reward_error"] > 0 and counts["trained"] > 0
    assert counts["generated"] == counts["trained"] + counts["dropped_reward_error"]
    scalars = read_scalars(cli.trainer.logger.log_dir)
    assert scalars["data/count/dropped_reward_error"][-1][1] == counts["dropped_reward_error"]


@pytest.mark.slow
def test_a_verifier_that_always_fails_stops_with_one_sentence(tmp_path):
    # Empty batches are skipped (tests/test_faults.py); three in a row stop the run.
    with pytest.raises(
        RuntimeError, match=r"^3 rollout batches in a row had no sample to train on \(counts"
    ):
        run(
            small_run(
                tmp_path,
                "--data.reward=tests.test_trainer.FailingReward",
                "--data.max_consecutive_empty_batches=3",
            )
        )


@pytest.mark.slow
def test_non_finite_values_stop_with_the_step_and_the_component(tmp_path):
    # A critic learning rate of 1e30 makes the critic's outputs non-finite after one update.
    with pytest.raises(
        ValueError, match=r"^rollout step 0, CriticLoss\(.*\): values has non-finite"
    ):
        run(small_run(tmp_path, "--model.critic_optimizer.init_args.lr=1e30"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--model.value_target.init_args.k=-1", "k must be an integer >= 0"),
        ("--model.ppo_epochs=0", "ppo_epochs must be an integer >= 1"),
        ("--data.lag=3", "max_staleness must be None or an integer >= lag=3"),
        ("--data.val_batches=-1", "val_batches must be an integer >= 0"),
        ("--model.actor=/nonexistent/model", "'/nonexistent/model' is neither 'tiny-char'"),
    ],
)
def test_bad_config_values_fail_with_one_sentence(tmp_path, override, message, capsys):
    with pytest.raises((ValueError, SystemExit)) as info:
        run(small_run(tmp_path, override))
    text = str(info.value) + capsys.readouterr().err
    assert message in text
