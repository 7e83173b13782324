"""Saved hyperparameters restore the run (checkpoints are named by rollout step): every value target, actor objective and critic loss comes
back from ``load_from_checkpoint`` (built in Python or by LightningCLI), and ``hparams.yaml`` holds
the configuration."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from brace_lightning.cli import run
from brace_lightning.hparams import from_config, to_config
from brace_lightning.logs import read_scalars
from brace_lightning.module import BraceModule
from brace_lightning.objectives import (
    DIS,
    ESTR,
    PPOEWMA,
    TIS,
    ActorObjective,
    CriticLoss,
    DecoupledPPO,
    IcePop,
    KPop,
    PPOClip,
)
from brace_lightning.targets import BRACE, GAE, ValueTarget, VTrace
from tests.test_trainer import CONFIGS, small_run

# One non-default setting each, so that a restored default would not pass.
TARGETS = [GAE(lmbda=0.9), VTrace(rho_bar=1.5), BRACE(k=7)]
OBJECTIVES = [
    PPOClip(clip_low=0.1),
    TIS(weight_cap=3.0),
    DecoupledPPO(clip_low=0.15),
    PPOEWMA(ewma_decay=0.9),
    IcePop(),
    KPop(),
    DIS(eps_low=0.2),
    ESTR(),
]


def _same(a: object, b: object) -> bool:
    return type(a) is type(b) and vars(a) == vars(b)


def test_every_target_and_objective_round_trips_through_its_config() -> None:
    for obj, base in [
        *((t, ValueTarget) for t in TARGETS),
        *((o, ActorObjective) for o in OBJECTIVES),
    ]:
        config = to_config(obj)
        assert yaml.safe_load(yaml.safe_dump(config)) == config  # plain data
        assert _same(from_config(config, base, "x"), obj), config
    assert _same(
        from_config(to_config(CriticLoss(clip=None)), CriticLoss, "x"), CriticLoss(clip=None)
    )


def test_from_config_rejects_what_is_not_a_subclass_config() -> None:
    with pytest.raises(ValueError, match="value_target has class_path 'os.system'"):
        from_config({"class_path": "os.system"}, ValueTarget, "value_target")
    with pytest.raises(ValueError, match="value_target must be a"):
        from_config(3, ValueTarget, "value_target")


def _checkpoint(module: BraceModule, path: Path) -> Path:
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path)
    return path


def test_load_from_checkpoint_restores_every_target_and_objective(tmp_path: Path) -> None:
    cases = [(t, PPOClip(), CriticLoss()) for t in TARGETS]
    cases += [(GAE(), o, CriticLoss(clip=0.3)) for o in OBJECTIVES]
    for i, (target, objective, critic_loss) in enumerate(cases):
        module = BraceModule(
            value_target=target,
            actor_objective=objective,
            critic_loss=critic_loss,
            tiny_hidden_size=32,
            tiny_num_layers=1,
        )
        path = _checkpoint(module, tmp_path / f"{i}.ckpt")
        loaded = BraceModule.load_from_checkpoint(path, weights_only=True)
        assert _same(loaded.value_target, target), target
        assert _same(loaded.actor_objective, objective), objective
        assert _same(loaded.critic_loss, critic_loss)
        for name, value in module.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), name


def test_load_from_checkpoint_restores_the_kl_arguments(tmp_path: Path) -> None:
    # Non-default values each, so that a restored default would not pass.
    cases = [(0.05, "k3", "loss"), (0.2, "k1", "reward"), (1.5, "k2", "loss")]
    for i, (coef, estimator, mode) in enumerate(cases):
        module = BraceModule(
            kl_coef=coef,
            kl_estimator=estimator,
            kl_mode=mode,
            tiny_hidden_size=32,
            tiny_num_layers=1,
        )
        path = _checkpoint(module, tmp_path / f"kl{i}.ckpt")
        loaded = BraceModule.load_from_checkpoint(path, weights_only=True)
        assert (loaded.kl_coef, loaded.kl_estimator, loaded.kl_mode) == (coef, estimator, mode)
        assert loaded.reference_actor is not None
        for name, value in module.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), name


def test_load_from_checkpoint_restores_pack_sequences(tmp_path: Path) -> None:
    module = BraceModule(
        pack_sequences=True, max_tokens_per_micro_batch=64, tiny_hidden_size=32, tiny_num_layers=1
    )
    loaded = BraceModule.load_from_checkpoint(
        _checkpoint(module, tmp_path / "packed.ckpt"), weights_only=True
    )
    assert loaded.scorer.pack_sequences is True and loaded.scorer.max_tokens == 64
    with pytest.raises(ValueError, match="pack_sequences must be a bool; got 'yes'"):
        BraceModule(pack_sequences="yes", tiny_hidden_size=32, tiny_num_layers=1)


@pytest.mark.slow
def test_cli_checkpoint_restores_target_and_objective_and_writes_hparams_yaml(
    tmp_path: Path,
) -> None:
    cli = run(
        small_run(
            tmp_path,
            "--config",
            str(CONFIGS / "targets" / "gae.yaml"),
            "--config",
            str(CONFIGS / "objectives" / "tis.yaml"),
            "--model.value_target.lmbda=0.9",
            "--model.critic_loss.clip=0.3",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
            "--model.num_minibatches=2",
            steps=2,
        )
    )
    (path,) = (tmp_path / "ckpt").glob("*.ckpt")
    # global_step counts rollout steps (not the 4 optimizer steps per network here).
    assert cli.trainer.global_step == 2 and path.name == "epoch=0-step=2.ckpt"
    loaded = BraceModule.load_from_checkpoint(path, weights_only=True)
    assert _same(loaded.value_target, cli.model.value_target)
    assert isinstance(loaded.value_target, GAE) and loaded.value_target.lmbda == 0.9
    assert _same(loaded.actor_objective, cli.model.actor_objective)
    assert isinstance(loaded.actor_objective, TIS)
    assert loaded.critic_loss.clip == 0.3
    assert (
        Path(cli.trainer.logger.log_dir).parent.name == "ArithmeticTask-GAE-TIS-lag0"
    )  # the quickstart samples on-policy
    scalars = read_scalars(cli.trainer.logger.log_dir)  # the HParams tab's final metrics
    assert scalars["hp/rollout_reward"] == [(2, scalars["rollout/reward"][-1][1])]
    saved = yaml.safe_load((Path(cli.trainer.logger.log_dir) / "hparams.yaml").read_text())
    assert saved["value_target"]["class_path"].endswith("GAE")
    assert saved["value_target"]["init_args"]["lmbda"] == 0.9
    assert saved["tiny_hidden_size"] == 64
