"""Critic-free value targets (GRPO, Dr. GRPO, RLOO) in the trainer: no critic built, no critic
optimizer; checkpoints, resume, export and every actor objective work; loss aggregation modes; the
prompt groups through the data path (staleness drops, ranks)."""

from __future__ import annotations

import types

import pytest
import torch

from brace_lightning.checkpoints import load_checkpoint
from brace_lightning.cli import run
from brace_lightning.data import RolloutDataModule
from brace_lightning.export import export_checkpoint
from brace_lightning.logs import read_scalars
from brace_lightning.module import BraceModule
from brace_lightning.optim import configure_optimizers
from brace_lightning.rollout.buffer import (
    StalenessBuffer,
    batch_from_state,
    batch_to_state,
    partial_groups,
)
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.targets import BRACE, GRPO, RLOO, DrGRPO
from tests.test_trainer import CONFIGS, actor_weights, small_run, stop_and_checkpoint_at

PARITY = "--data.reward=tests.test_trainer.ParityReward"  # rewards with spread from a random model
OBJECTIVES = sorted((CONFIGS / "objectives").glob("*.yaml"))


@pytest.mark.parametrize("target", [GRPO, DrGRPO, RLOO])
def test_a_critic_free_module_has_no_critic_parameters_and_one_optimizer(target) -> None:
    module = BraceModule(value_target=target(), tiny_hidden_size=32, tiny_num_layers=1)
    assert module.critic is None
    assert not [name for name, _ in module.named_parameters() if not name.startswith("actor.")]
    assert not [key for key in module.state_dict() if key.startswith("critic.")]
    assert module.critic_warmup_steps == 0  # no critic to warm up
    assert module.whiten_advantages is False  # the group statistics normalise
    built: list[str] = []

    def factory(name: str):
        def build(params):
            built.append(name)
            return torch.optim.SGD(params, lr=0.1)

        return build

    opts, schedulers = configure_optimizers(
        module.actor, module.critic, (factory("actor"), factory("critic")), (None, None)
    )
    assert built == ["actor"] and len(opts) == 1 and schedulers == []
    critic_based = BraceModule(value_target=BRACE(), tiny_hidden_size=32, tiny_num_layers=1)
    assert critic_based.critic is not None and critic_based.whiten_advantages is True
    explicit = BraceModule(value_target=GRPO(), whiten_advantages=True, tiny_hidden_size=32)
    assert explicit.whiten_advantages is True


def test_meta_init_with_a_critic_free_target_is_refused_in_one_sentence() -> None:
    with pytest.raises(ValueError, match="fsdp_meta_init=True needs a critic-based value_target"):
        BraceModule(value_target=GRPO(), fsdp_meta_init=True, tiny_hidden_size=32)


def test_bad_loss_aggregation_is_refused_in_one_sentence() -> None:
    with pytest.raises(ValueError, match="loss_aggregation must be one of"):
        BraceModule(loss_aggregation="sum", tiny_hidden_size=32)
    with pytest.raises(ValueError, match="loss_max_len must be None or an int >= 1"):
        BraceModule(loss_aggregation="seq_mean_token_sum", loss_max_len=0, tiny_hidden_size=32)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["grpo", "drgrpo", "rloo"])
def test_cli_fit_with_each_critic_free_overlay_trains_the_actor_alone(tmp_path, target):
    overlay = str(CONFIGS / "targets" / f"{target}.yaml")
    cli = run(small_run(tmp_path, "--config", overlay, PARITY, "--data.samples_per_prompt=4"))
    module = cli.model
    assert module.critic is None and module.policy_version == 2
    scalars = read_scalars(cli.trainer.logger.log_dir)
    assert [step for step, _ in scalars["actor/loss"]] == [1, 2]
    assert not [name for name in scalars if name.startswith(("critic/", "lr/critic"))]
    assert any(value != 0.0 for _, value in scalars["rollout/advantage_max"])


@pytest.mark.slow
def test_async_producer_and_the_importance_weighted_baseline_train_on_stale_groups(tmp_path):
    asynchronous = run(
        small_run(
            tmp_path / "async",
            "--config",
            str(CONFIGS / "async.yaml"),
            "--model.value_target=GRPO",
            PARITY,
            "--data.samples_per_prompt=4",
            steps=3,
        )
    )
    assert asynchronous.model.critic is None and asynchronous.model.policy_version == 3
    stale = ("--data.lag=2", "--data.max_staleness=2", PARITY, "--data.samples_per_prompt=4")
    advantages = {}
    for name in ("grpo", "grpo_is"):
        overlay = str(CONFIGS / "targets" / f"{name}.yaml")
        cli = run(small_run(tmp_path / name, "--config", overlay, *stale, steps=4))
        scalars = read_scalars(cli.trainer.logger.log_dir)
        assert max(value for _, value in scalars["data/staleness_max"]) == 2.0
        advantages[name] = [value for _, value in scalars["rollout/advantage_std"]]
    # Same samples until the weights differ; the weighted baseline moves the advantages once
    # π ≠ µ (from the first stale step on).
    assert advantages["grpo"] != advantages["grpo_is"]


@pytest.mark.slow
def test_loss_aggregation_changes_the_update(tmp_path):
    args = ("--model.value_target=GRPO", PARITY, "--data.samples_per_prompt=4")
    weights = {}
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        cli = run(small_run(tmp_path / mode, *args, f"--model.loss_aggregation={mode}", steps=1))
        weights[mode] = actor_weights(cli)
    first = next(iter(weights["token_mean"]))
    values = [w[first] for w in weights.values()]
    assert not torch.equal(values[0], values[1]) and not torch.equal(values[1], values[2])


@pytest.mark.slow
def test_checkpoint_has_no_critic_and_resumes_exactly_and_exports_the_actor_alone(tmp_path):
    common = ["--model.value_target=GRPO", PARITY, "--model.ppo_epochs=1"]
    save = stop_and_checkpoint_at(tmp_path / "ckpt", 5)
    first = run(small_run(tmp_path / "first", *common, *save, steps=6))
    (checkpoint,) = (tmp_path / "ckpt").iterdir()
    state = load_checkpoint(checkpoint)
    assert not [k for k in state["state_dict"] if not k.startswith("actor.")]
    assert len(state["optimizer_states"]) == 1
    assert first.model.rollout_step == 5  # global_step counts rollout steps
    resumed = run(small_run(tmp_path / "resumed", *common, f"--ckpt_path={checkpoint}", steps=6))
    reference = run(small_run(tmp_path / "reference", *common, steps=6))
    a, b = actor_weights(reference), actor_weights(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    out = export_checkpoint(checkpoint, tmp_path / "exported")
    assert sorted(p.name for p in out.iterdir()) == ["actor"]


@pytest.mark.slow
@pytest.mark.parametrize("objective", OBJECTIVES, ids=[p.stem for p in OBJECTIVES])
def test_every_actor_objective_trains_with_a_critic_free_target(tmp_path, objective):
    cli = run(
        small_run(
            tmp_path, "--config", str(objective), "--model.value_target=RLOO", PARITY, steps=1
        )
    )
    assert cli.model.critic is None and cli.model.policy_version == 1
    loss = read_scalars(cli.trainer.logger.log_dir)["actor/loss"]
    assert len(loss) == 1 and torch.isfinite(torch.tensor(loss[0][1]))


# ------------------------------------------------------------------ groups through the data path


def _batch(group_ids: list[int], versions: list[int]) -> RolloutBatch:
    rows = len(group_ids)
    mask = torch.ones(rows, 3, dtype=torch.bool)
    mask[-1] = torch.tensor([True, False, False])
    return RolloutBatch(
        input_ids=torch.arange(rows * 3).view(rows, 3),
        attention_mask=torch.ones(rows, 3, dtype=torch.bool),
        mask=mask,
        behavior_logprobs=torch.zeros(rows, 3),
        versions=torch.tensor(versions)[:, None].expand(rows, 3).clone(),
        rewards=torch.zeros(rows, 3),
        scores=torch.arange(rows, dtype=torch.float32),
        group_ids=torch.tensor(group_ids),
    )


def test_the_buffer_keeps_group_ids_and_partial_groups_are_counted():
    batch = _batch([4, 4, 4, 9, 9, 9], versions=[0, 3, 3, 3, 3, 3])
    buffer = StalenessBuffer(max_staleness=1)
    buffer.put(0, batch_from_state(batch_to_state(batch)))  # as it crosses the producer pipe
    kept, report = buffer.pop(0, trainer_version=3)
    assert report.dropped_stale == 1
    assert kept.group_ids.tolist() == [4, 4, 9, 9, 9]
    assert partial_groups(kept.group_ids, group_size=3) == 1
    # The survivors' baseline is theirs alone: GRPO of the partial group over its two rows.
    rewards = torch.zeros(5, 3)
    rewards[:, 0] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    out = DrGRPO()(
        rewards=rewards,
        values=rewards,
        target_logprobs=rewards,
        behavior_logprobs=rewards,
        mask=kept.mask,
        group_ids=kept.group_ids,
    )
    assert out.advantages[:, 0].tolist() == pytest.approx([0.5, -0.5, -2 / 3, 1 / 3, 1 / 3])


def test_group_ids_are_unique_over_ranks_and_steps():
    def offsets(rank: int, world: int) -> list[int]:
        dm = RolloutDataModule.__new__(RolloutDataModule)
        dm._next_group = 0
        dm.trainer = types.SimpleNamespace(global_rank=rank, world_size=world)
        return [dm._group_id_offset(4) for _ in range(3)]

    single = offsets(0, 1)
    assert single == [0, 4, 8]  # one process: the ids of before
    ids = set()
    for rank in range(2):
        for offset in offsets(rank, 2):
            ids.update(range(offset, offset + 4))
    assert len(ids) == 2 * 3 * 4


def test_the_importance_weighted_arm_differs_from_grpo_only_in_its_baseline():
    import yaml

    grpo, weighted = (
        yaml.safe_load((CONFIGS / "targets" / f"{name}.yaml").read_text())
        for name in ("grpo", "grpo_is")
    )
    assert weighted["model"]["value_target"]["init_args"].pop("baseline_rho_bar") == 1.2
    assert grpo["model"]["value_target"]["init_args"].pop("baseline_rho_bar") is None
    assert weighted == grpo


def test_the_optimal_baseline_arm_differs_from_grpo_only_in_its_baseline():
    import yaml

    grpo, optimal = (
        yaml.safe_load((CONFIGS / "targets" / f"{name}.yaml").read_text())
        for name in ("grpo", "grpo_opob")
    )
    assert optimal["model"]["value_target"]["init_args"].pop("optimal_baseline") is True
    assert optimal == grpo
    proxy = yaml.safe_load((CONFIGS / "targets" / "grpo_opob_logits.yaml").read_text())
    assert proxy["model"]["value_target"]["init_args"].pop("score_norm") == "logits"
    assert proxy["model"]["value_target"]["init_args"].pop("optimal_baseline") is True
    assert proxy == grpo


@pytest.mark.slow
def test_the_optimal_baseline_trains_on_stale_groups_with_other_advantages_than_grpo(tmp_path):
    """GRPO and its optimal-baseline overlays (exact norms and the logit proxy) from the same seed,
    2 versions stale: all see the same first batch; the baseline weighted by w² ‖g‖² gives other
    advantages (the responses' gradient norms differ) and so another actor. That the norm pass writes no ``.grad`` is
    tested on the Scorer (test_module.py)."""
    stale = ("--data.lag=2", "--data.max_staleness=2", PARITY, "--data.samples_per_prompt=4")
    scalars, actors = {}, {}
    for name in ("grpo", "grpo_opob", "grpo_opob_logits"):
        overlay = str(CONFIGS / "targets" / f"{name}.yaml")
        cli = run(small_run(tmp_path / name, "--config", overlay, *stale, steps=3))
        assert cli.model.critic is None and cli.model.policy_version == 3
        scalars[name] = read_scalars(cli.trainer.logger.log_dir)
        actors[name] = actor_weights(cli)
    assert max(value for _, value in scalars["grpo_opob"]["data/staleness_max"]) == 2.0
    rewards = [[v for _, v in scalars[n]["rollout/reward"]][0] for n in scalars]
    assert rewards[0] == rewards[1] == rewards[2]  # the same first batch
    stds = {n: [v for _, v in scalars[n]["rollout/advantage_std"]] for n in scalars}
    assert stds["grpo"] != stds["grpo_opob"] and stds["grpo"] != stds["grpo_opob_logits"]
    assert stds["grpo_opob"] != stds["grpo_opob_logits"]  # another norm, other weights
    first = next(iter(actors["grpo"]))
    for name in ("grpo_opob", "grpo_opob_logits"):
        assert not torch.equal(actors["grpo"][first], actors[name][first])
