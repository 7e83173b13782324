"""Every actor objective composed with every value target in short CLI runs on the tiny model.

Runs use ``data.lag = 1``: from the second rollout step on the engine samples with the previous
version's weights, so the behavior weights π_prox/µ differ from 1 and every rule has work to do.
Also: the per-step logs of what each rule did (fractions, weight statistics, token counts), and
the PPO-EWMA actor (bias-corrected average, used as π_prox, timed, checkpointed, exactly resumed).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from brace_lightning.cli import run
from brace_lightning.logs import read_scalars
from brace_lightning.module import BraceModule
from brace_lightning.objectives import PPOEWMA
from tests.test_trainer import (
    CONFIGS,
    actor_weights,
    small_run,
    stop_and_checkpoint_at,
)

TARGETS = {"gae": "GAE", "vtrace": "VTrace", "brace": "BRACE"}
OBJECTIVES = {
    "ppo": "PPOClip",
    "tis": "TIS",
    "decoupled": "DecoupledPPO",
    "ewma": "PPOEWMA",
    "icepop": "IcePop",
    "kpop": "KPop",
    "dis": "DIS",
    "estr": "ESTR",
}
PPO_STATS = {
    "actor/clip_low_fraction",
    "actor/clip_high_fraction",
    "actor/clip_low_tokens",
    "actor/clip_high_tokens",
    "actor/ratio_mean",
    "actor/approx_kl_mean",
}
WEIGHT_STATS = {"actor/weight_mean", "actor/weight_max"}
MASK_STATS = {"actor/masked_fraction", "actor/masked_tokens"}
TRUNCATION_STATS = {"actor/truncated_fraction", "actor/truncated_tokens"}
# What each objective must report every step, on top of actor/loss and actor/grad_norm.
LOGGED = {
    "ppo": PPO_STATS,
    "tis": PPO_STATS | WEIGHT_STATS | TRUNCATION_STATS,
    "decoupled": PPO_STATS | WEIGHT_STATS | TRUNCATION_STATS | MASK_STATS,
    "ewma": PPO_STATS | WEIGHT_STATS | TRUNCATION_STATS | MASK_STATS | {"time/ewma_forward_ms"},
    "icepop": PPO_STATS | WEIGHT_STATS | MASK_STATS,
    "kpop": PPO_STATS | WEIGHT_STATS | MASK_STATS | {"actor/binary_kl_mean"},
    "dis": WEIGHT_STATS | MASK_STATS,
    "estr": PPO_STATS | WEIGHT_STATS | MASK_STATS | {"actor/score_mean"},
}


def overlays(objective: str, target: str) -> list[str]:
    """The two overlays, and the update schedule the step counts below assume (one pass over two
    minibatches per rollout step), pinned whatever the quickstart uses."""
    return [
        "--config",
        str(CONFIGS / "objectives" / f"{objective}.yaml"),
        "--config",
        str(CONFIGS / "targets" / f"{target}.yaml"),
        "--model.ppo_epochs=1",
        "--model.num_minibatches=2",
    ]


def batch_tokens(scalars: dict[str, list[tuple[int, float]]], step: int) -> float:
    """Action tokens of rollout step ``step``'s batch: mean response length × rows trained."""
    trained = dict(scalars["data/count/trained"])
    rows = trained[step] - trained.get(step - 1, 0.0)
    return dict(scalars["rollout/response_length"])[step] * rows


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_every_objective_trains_with_every_value_target(
    tmp_path: Path, objective: str, target: str
) -> None:
    cli = run(small_run(tmp_path, *overlays(objective, target), "--data.lag=1"))
    model = cli.model
    assert type(model.actor_objective).__name__ == OBJECTIVES[objective]
    assert type(model.value_target).__name__ == TARGETS[target]
    assert (model.rollout_step, model.policy_version) == (2, 2)
    assert (model.ewma_actor is not None) == (objective == "ewma")
    initial = BraceModule(tiny_hidden_size=64, tiny_num_layers=1).actor.state_dict()
    trained = actor_weights(cli)
    assert any(not torch.equal(trained[name], initial[name]) for name in initial)

    scalars = read_scalars(cli.trainer.logger.log_dir)
    for name in {"actor/loss", "actor/grad_norm"} | LOGGED[objective]:
        assert [step for step, _ in scalars.get(name, [])] == [1, 2], name
        assert all(math.isfinite(value) for _, value in scalars[name]), name
    # lag = 1: the second batch was sampled by version 0 and trained at version 1.
    assert dict(scalars["data/staleness_mean"]) == {1: 0.0, 2: 1.0}
    assert dict(scalars["mismatch/abs_logprob_diff"])[2] > 1e-3
    for name, series in scalars.items():
        if name.startswith("actor/") and name.endswith("_fraction"):
            assert all(0.0 <= value <= 1.0 for _, value in series), name
        if name.startswith("actor/") and name.endswith("_tokens"):
            for step, value in series:
                assert value == int(value) and 0 <= value <= batch_tokens(scalars, step), name


@pytest.mark.slow
def test_removed_token_counts_match_a_rule_that_removes_every_stale_token(tmp_path: Path) -> None:
    # IcePop's band [1, 1] keeps only tokens with π_prox/µ exactly 1: none once the data is stale.
    cli = run(
        small_run(
            tmp_path,
            *overlays("icepop", "brace"),
            "--data.lag=1",
            "--model.actor_objective.init_args.alpha=1.0",
            "--model.actor_objective.init_args.beta=1.0",
            "--model.ppo_epochs=3",  # counts are per pass over the batch, not summed over passes
        )
    )
    scalars = read_scalars(cli.trainer.logger.log_dir)
    assert dict(scalars["data/staleness_mean"])[2] == 1.0
    assert dict(scalars["actor/masked_fraction"])[2] == 1.0
    assert dict(scalars["actor/masked_tokens"])[2] == batch_tokens(scalars, 2)
    assert dict(scalars["actor/loss"])[2] == 0.0
    # On-policy (step 1) the same rule keeps tokens, and the count says how many it removed.
    assert dict(scalars["actor/masked_tokens"])[1] < batch_tokens(scalars, 1)


def test_ewma_actor_is_the_bias_corrected_average_of_the_weights_after_each_step() -> None:
    decay = 0.8
    module = BraceModule(
        tiny_hidden_size=64, tiny_num_layers=1, actor_objective=PPOEWMA(ewma_decay=decay)
    )
    assert module.ewma_actor is not None and int(module.ewma.steps) == 0
    generator = torch.Generator().manual_seed(0)
    snapshots = []
    for _ in range(3):
        with torch.no_grad():
            for param in module.actor.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))
        snapshots.append([p.detach().clone() for p in module.actor.parameters()])
        module.ewma.update(module.actor)
    assert int(module.ewma.steps) == 3
    # θ_ewma = Σ_i (1 − β) β^(n−i) θ_i / (1 − β^n): weights that sum to 1.
    coefficients = [(1 - decay) * decay ** (3 - i) / (1 - decay**3) for i in (1, 2, 3)]
    for k, ewma in enumerate(module.ewma_actor.parameters()):
        expected = sum(c * snapshot[k] for c, snapshot in zip(coefficients, snapshots, strict=True))
        torch.testing.assert_close(ewma, expected, rtol=1e-5, atol=1e-6)
    assert not any(p.requires_grad for p in module.ewma_actor.parameters())


@pytest.mark.slow
def test_ewma_logprobs_are_the_proximal_policy_and_their_forward_is_timed(tmp_path: Path) -> None:
    # One minibatch per step, so π_θ = the actor at the step's start on the only minibatch and
    # r = π_θ/π_prox shows which policy was passed as π_prox. A short warm start moves the actor
    # away from its initialisation first: π_prox must follow it.
    warm_start = [
        "--trainer.callbacks+=brace_lightning.callbacks.SupervisedWarmStart",
        "--trainer.callbacks.num_pairs=64",
        "--trainer.callbacks.steps=3",
        "--trainer.callbacks.batch_size=16",
    ]
    cli = run(
        small_run(
            tmp_path,
            *overlays("ewma", "brace"),
            *warm_start,
            "--data.lag=0",
            "--model.num_minibatches=1",
            steps=3,
        )
    )
    assert int(cli.model.ewma.steps) == 3
    scalars = read_scalars(cli.trainer.logger.log_dir)
    kl = dict(scalars["actor/approx_kl_mean"])
    forward_ms = dict(scalars["time/ewma_forward_ms"])
    # Step 1: no actor step yet, π_prox is the (warm-started) actor and no extra forward runs.
    assert kl[1] < 1e-9 and forward_ms[1] == 0.0
    # Step 2: the EWMA of one observation θ_1 is θ_1 itself.
    assert kl[2] < 1e-9 and forward_ms[2] > 0.0
    # Step 3: the EWMA of θ_1, θ_2 lags the actor θ_2.
    assert kl[3] > 1e-6 and forward_ms[3] > 0.0


@pytest.mark.slow
def test_ewma_weights_are_checkpointed_and_resume_exactly(tmp_path: Path) -> None:
    # As tests/test_trainer.py's resume test: stopped after rollout step 3.
    common = [
        *overlays("ewma", "brace"),
        "--data.lag=1",
        "--model.critic_warmup_steps=1",
        "--trainer.limit_train_batches=4",
    ]
    straight = run(small_run(tmp_path / "straight", *common, steps=4))
    save = stop_and_checkpoint_at(tmp_path / "ckpt", 3)
    first = run(small_run(tmp_path / "first", *common, *save, steps=4))
    assert first.model.rollout_step == 3 and int(first.model.ewma.steps) == 4
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")  # named by rollout step
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    assert int(saved["ewma.steps"]) == 4
    ewma_keys = {f"ewma.policy.{name}" for name in first.model.ewma_actor.state_dict()}
    assert ewma_keys <= saved.keys()
    resumed = run(small_run(tmp_path / "resumed", *common, f"--ckpt_path={checkpoint}", steps=4))

    # 3 actor-training rollout steps × 2 minibatches.
    assert int(straight.model.ewma.steps) == int(resumed.model.ewma.steps) == 6
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    ewma, actor = straight.model.ewma_actor.state_dict(), straight.model.actor.state_dict()
    assert any(not torch.equal(ewma[name], actor[name]) for name in actor), "EWMA = actor"
