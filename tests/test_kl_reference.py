"""The optional KL to a frozen reference policy (``BraceModule(kl_coef=...)``).

Off by default: no reference model, no extra state, no extra metric. On: the per-token estimators
against a float64 loop, the loss term's value, normalisation and gradient (through π only, also
with token-budget micro-batches), the reward penalty (exactly −coef·KL at actions), the reference
as the run's initial policy (after a warm start, after optimizer steps, after a checkpoint resume,
sharded under FSDP2, equal on DDP ranks), the logged ``kl/ref`` and the one-sentence errors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from brace_lightning.cli import run
from brace_lightning.logs import read_scalars
from brace_lightning.models.parallelize import full_state_dict
from brace_lightning.models.policy import token_logprobs
from brace_lightning.module import BraceModule
from brace_lightning.objectives.functional import KL_ESTIMATORS, kl_to_reference
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.targets import GAE
from tests.support.dist_support import one_process_group
from tests.support.parallel_driver import _Repeat
from tests.test_parallel import _cli, _driver
from tests.test_trainer import CONFIGS, small_run, stop_and_checkpoint_at

OVERLAY = ["--config", str(CONFIGS / "objectives" / "kl_reference.yaml")]
WARM_START = [
    "--trainer.callbacks+=brace_lightning.callbacks.SupervisedWarmStart",
    "--trainer.callbacks.num_pairs=64",
    "--trainer.callbacks.steps=3",
    "--trainer.callbacks.batch_size=16",
]
TINY = {"tiny_hidden_size": 64, "tiny_num_layers": 1}


# ---------------------------------------------------------------------- the estimators


def _masked_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random log-probs ``[5, 11]`` and a mask with a prompt, holes (tool outputs) and padding;
    the non-actions hold garbage (inf, NaN) that must reach neither values nor gradients."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(5, 11, generator=g, dtype=torch.float64) * 4
    reference = -torch.rand(5, 11, generator=g, dtype=torch.float64) * 4
    mask = torch.zeros(5, 11, dtype=torch.bool)
    mask[:, 3:10] = True
    mask[1, 5:7] = False  # a hole
    mask[2, 4] = mask[2, 8] = False  # two holes
    mask[3, 7:] = False  # a shorter row
    mask[4] = False  # no action at all
    logprobs[~mask] = math.inf
    reference[~mask] = math.nan
    return logprobs.float(), reference.float(), mask


def _slow_kl(estimator: str, logprob: float, reference: float) -> tuple[float, float]:
    """(KL estimate, its derivative in log π) of one token, in Python float64 math."""
    log_ratio = logprob - reference
    if estimator == "k1":
        return log_ratio, 1.0
    if estimator == "k2":
        return 0.5 * log_ratio**2, log_ratio
    r = math.exp(reference - logprob)  # π_ref / π
    return r - 1.0 - math.log(r), 1.0 - r


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_each_estimator_matches_a_float64_loop_and_ignores_non_actions(estimator: str) -> None:
    logprobs, reference, mask = _masked_inputs()
    logprobs.requires_grad_(True)
    kl = kl_to_reference(logprobs, reference, mask, estimator=estimator)
    kl.sum().backward()
    assert logprobs.grad is not None
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                assert kl[b, t] == 0.0 and logprobs.grad[b, t] == 0.0, (b, t)
                continue
            value, slope = _slow_kl(estimator, float(logprobs[b, t]), float(reference[b, t]))
            assert float(kl[b, t]) == pytest.approx(value, rel=1e-5, abs=1e-6), (b, t)
            assert float(logprobs.grad[b, t]) == pytest.approx(slope, rel=1e-5, abs=1e-6), (b, t)
    if estimator != "k1":  # k2 and k3 are non-negative per token; k1 is not
        assert bool((kl >= 0).all())
    else:
        assert bool((kl[mask] < 0).any()) and bool((kl[mask] > 0).any())


def test_every_estimator_is_zero_at_the_reference_itself() -> None:
    logprobs, _, mask = _masked_inputs()
    for estimator in KL_ESTIMATORS:
        kl = kl_to_reference(logprobs, logprobs.clone(), mask, estimator=estimator)
        assert bool((kl == 0).all()), estimator


def test_an_unknown_estimator_is_a_clear_error() -> None:
    logprobs, reference, mask = _masked_inputs()
    with pytest.raises(ValueError, match=r"^estimator must be one of k1, k2, k3; got 'kl'\.$"):
        kl_to_reference(logprobs, reference, mask, estimator="kl")


# ---------------------------------------------------------------------- construction


def test_kl_coef_zero_builds_no_reference_and_adds_no_state() -> None:
    module = BraceModule(**TINY)
    assert module.reference_actor is None and module.hparams["kl_coef"] == 0.0
    assert not [key for key in module.state_dict() if "reference" in key]
    checkpoint: dict[str, Any] = {}
    module.on_save_checkpoint(checkpoint)
    assert "reference_captured" not in checkpoint["brace"]


def test_the_reference_is_frozen_in_eval_mode_and_in_no_optimizer() -> None:
    module = BraceModule(**TINY, kl_coef=0.1)
    reference = module.reference_actor
    assert reference is not None and reference is not module.actor
    module.train()  # Lightning sets training mode: the reference stays in eval mode
    assert module.actor.training and not any(m.training for m in reference.modules())
    assert not any(p.requires_grad for p in reference.parameters())
    (actor_opt, critic_opt), _ = module.configure_optimizers()
    optimized = {
        id(p) for opt in (actor_opt, critic_opt) for g in opt.param_groups for p in g["params"]
    }
    assert optimized and not optimized & {id(p) for p in reference.parameters()}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kl_coef": -0.1}, "kl_coef must be a finite number >= 0; got -0.1."),
        ({"kl_coef": math.inf}, "kl_coef must be a finite number >= 0; got inf."),
        ({"kl_coef": math.nan}, "kl_coef must be a finite number >= 0; got nan."),
        ({"kl_coef": True}, "kl_coef must be a finite number >= 0; got True."),
        ({"kl_estimator": "k4"}, "kl_estimator must be one of k1, k2, k3; got 'k4'."),
        ({"kl_mode": "both"}, "kl_mode must be one of loss, reward; got 'both'."),
    ],
)
def test_bad_kl_arguments_are_one_sentence(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        BraceModule(**TINY, **kwargs)
    assert str(info.value) == message


def test_a_bad_kl_coef_on_the_command_line_is_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises((ValueError, SystemExit)) as info:
        run(small_run(tmp_path, "--model.kl_coef=-1"))
    assert "kl_coef must be a finite number >= 0; got -1.0." in str(info.value) + (
        capsys.readouterr().err
    )


# ---------------------------------------------------------------------- one step on a fixed batch


def fixed_batch(seed: int = 0) -> RolloutBatch:
    """6 rows: a left-padded prompt, 4–9 actions with a hole (a tool output) in every other row,
    right padding; random rewards at every column (only the actions' may change)."""
    g = torch.Generator().manual_seed(seed)
    rows, width, prompt = 6, 16, 4
    input_ids = torch.randint(3, 60, (rows, width), generator=g)
    attention = torch.zeros(rows, width, dtype=torch.bool)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for row in range(rows):
        end = prompt + 4 + row
        attention[row, prompt - 2 - row % 3 : end] = True
        mask[row, prompt:end] = True
        if row % 2:
            mask[row, prompt + 2 : prompt + 4] = False
    return RolloutBatch(
        input_ids=torch.where(attention, input_ids, 0),
        attention_mask=attention,
        mask=mask,
        behavior_logprobs=torch.where(mask, -torch.rand(rows, width, generator=g) * 3 - 1, 0.0),
        versions=torch.where(mask, 0, -1),
        rewards=torch.randn(rows, width, generator=g),
        scores=torch.rand(rows, generator=g),
        group_ids=torch.arange(rows) // 2,
    )


class OneBatch(pl.LightningDataModule):
    """The same rollout batch every step."""

    def __init__(self, batch: RolloutBatch) -> None:
        super().__init__()
        self.batch = batch

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Repeat(self.batch), batch_size=None)


class RecordingGAE(GAE):
    """GAE that keeps the rewards it was given (to see the reward penalty)."""

    def __call__(self, **kwargs: torch.Tensor) -> Any:
        self.rewards = kwargs["rewards"].detach().clone()
        return super().__call__(**kwargs)


def sgd_module(**kwargs: Any) -> BraceModule:
    """A tiny module whose actor takes one plain SGD step (lr 1, no clipping) per rollout step,
    so weight differences are gradient differences."""
    return BraceModule(
        **TINY,
        critic_warmup_steps=0,
        max_grad_norm=None,
        actor_optimizer=functools.partial(torch.optim.SGD, lr=1.0),
        critic_optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        **kwargs,
    )


def fit_steps(module: BraceModule, batch: RolloutBatch, steps: int = 1) -> dict[str, float]:
    """Train ``steps`` rollout steps on ``batch``; the metrics logged at the last one."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=OneBatch(batch))
    return {name: float(value) for name, value in trainer.callback_metrics.items()}


def perturbed_reference(module: BraceModule, seed: int = 1) -> dict[str, torch.Tensor]:
    """Make the module's reference differ from its actor, as if captured earlier; its weights."""
    assert module.reference_actor is not None
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.reference_actor.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.05)
    module.reference.captured = True
    return {k: v.clone() for k, v in module.reference_actor.state_dict().items()}


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def batch_kl(
    actor: torch.nn.Module, reference: torch.nn.Module, batch: RolloutBatch, estimator: str
) -> torch.Tensor:
    """Per-token KL of ``actor`` (differentiable) to ``reference`` on ``batch``."""
    logprobs = token_logprobs(actor, batch.input_ids, batch.attention_mask)[0]
    with torch.no_grad():
        ref = token_logprobs(reference, batch.input_ids, batch.attention_mask)[0]
    return kl_to_reference(logprobs, ref, batch.mask, estimator=estimator)


@pytest.mark.parametrize(
    ("estimator", "budget"), [("k1", None), ("k2", None), ("k3", None), ("k3", 24)]
)
def test_loss_mode_adds_coef_times_mean_kl_with_its_gradient_through_pi_only(
    estimator: str, budget: int | None
) -> None:
    batch, coef = fixed_batch(), 0.5
    plain = sgd_module()
    start = weights(plain.actor)
    plain_metrics = fit_steps(plain, batch)
    # micro-batches: by rows and by a token budget; the term is still over the minibatch's count
    split = {"micro_batch_size": 2, "max_tokens_per_micro_batch": budget} if budget else {}
    kl_module = sgd_module(kl_coef=coef, kl_estimator=estimator, kl_mode="loss", **split)
    reference = perturbed_reference(kl_module)
    assert plain.reference_actor is None
    # The expected term and gradient, by hand: coef · Σ KL / action tokens at the start weights.
    actor = BraceModule(**TINY).actor
    actor.load_state_dict(start)
    kl = batch_kl(actor, kl_module.reference_actor, batch, estimator)
    term = coef * kl.sum() / batch.mask.sum()
    term.backward()
    kl_metrics = fit_steps(kl_module, batch)

    assert kl_metrics["kl/ref"] == pytest.approx(float(kl.sum() / batch.mask.sum()), rel=1e-5)
    assert kl_metrics["actor/kl_ref_loss"] == pytest.approx(float(term), rel=1e-5)
    assert kl_metrics["actor/loss"] - plain_metrics["actor/loss"] == pytest.approx(
        float(term), rel=1e-4, abs=1e-7
    )
    assert "actor/kl_ref_loss" not in plain_metrics and "kl/ref" not in plain_metrics
    # One SGD step of lr 1: the weights differ from the plain run's by −∇(term) exactly.
    moved, plain_moved = weights(kl_module.actor), weights(plain.actor)
    grads = {name: p.grad for name, p in actor.named_parameters()}
    assert all(g is not None for g in grads.values())
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-3
    for name, grad in grads.items():
        torch.testing.assert_close(moved[name] - plain_moved[name], -grad, rtol=1e-3, atol=2e-6)
    # π_ref got no gradient and did not move.
    assert all(p.grad is None for p in kl_module.reference_actor.parameters())
    for name, value in kl_module.reference_actor.state_dict().items():
        assert torch.equal(value, reference[name]), name


def test_k3_loss_at_the_reference_itself_changes_nothing() -> None:
    """At π = π_ref the k3 term and its gradient are exactly 0: the step is bit for bit the one
    without the KL (the KL path leaves everything else alone)."""
    batch = fixed_batch()
    plain, kl_module = sgd_module(), sgd_module(kl_coef=0.5, kl_estimator="k3")
    plain_metrics, kl_metrics = fit_steps(plain, batch), fit_steps(kl_module, batch)
    assert kl_metrics["kl/ref"] == 0.0 and kl_metrics["actor/kl_ref_loss"] == 0.0
    assert kl_metrics["actor/loss"] == plain_metrics["actor/loss"]
    for model in ("actor", "critic"):
        a, b = weights(getattr(plain, model)), weights(getattr(kl_module, model))
        assert all(torch.equal(a[name], b[name]) for name in a), model


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_reward_mode_changes_the_rewards_by_minus_coef_kl_at_actions_only(estimator: str) -> None:
    batch, coef = fixed_batch(), 0.3
    module = sgd_module(
        kl_coef=coef, kl_estimator=estimator, kl_mode="reward", value_target=RecordingGAE()
    )
    perturbed_reference(module)
    start = BraceModule(**TINY).actor  # the actor at the start of the step: π_prox
    with torch.no_grad():
        kl = batch_kl(start, module.reference_actor, batch, estimator)
    metrics = fit_steps(module, batch)
    seen = module.value_target.rewards
    mask = batch.mask
    assert torch.equal(seen[~mask], batch.rewards[~mask])  # nothing else changed
    torch.testing.assert_close(seen[mask], batch.rewards[mask] - coef * kl[mask])
    assert float((seen[mask] - batch.rewards[mask]).abs().max()) > 1e-4  # the penalty is there
    assert metrics["kl/ref"] == pytest.approx(float(kl.sum() / mask.sum()), rel=1e-5)
    assert metrics["kl/ref_penalty"] == pytest.approx(float(-coef * kl.sum(1).mean()), rel=1e-5)
    assert "actor/kl_ref_loss" not in metrics  # no loss term, no gradient from the KL


def test_the_reference_is_captured_once_and_stays_the_initial_policy() -> None:
    batch = fixed_batch()
    module = sgd_module(kl_coef=0.1)
    with torch.no_grad():  # a stand-in for a warm start: the actor moves before RL starts
        for param in module.actor.parameters():
            param.mul_(1.5)
    initial = weights(module.actor)
    metrics = fit_steps(module, batch, steps=3)
    assert module.reference.captured
    reference, actor = weights(module.reference_actor), weights(module.actor)
    assert all(torch.equal(reference[name], initial[name]) for name in initial)
    assert any(not torch.equal(actor[name], initial[name]) for name in initial)
    assert metrics["kl/ref"] > 0.0  # step 3 measures the moved actor against the initial one


# ---------------------------------------------------------------------- checkpoints


def _checkpoint(module: BraceModule, path: Path) -> Path:
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path)
    return path


def test_a_checkpoint_keeps_the_reference_and_kl_off_drops_it(tmp_path: Path) -> None:
    module = BraceModule(**TINY, kl_coef=0.1, kl_estimator="k1", kl_mode="reward")
    reference = perturbed_reference(module)
    path = _checkpoint(module, tmp_path / "kl.ckpt")
    loaded = BraceModule.load_from_checkpoint(path, weights_only=True)
    assert (loaded.kl_coef, loaded.kl_estimator, loaded.kl_mode) == (0.1, "k1", "reward")
    assert loaded.reference.captured  # so a later fit does not capture the loaded actor
    for name, value in loaded.reference_actor.state_dict().items():
        assert torch.equal(value, reference[name]), name
    off = BraceModule.load_from_checkpoint(path, weights_only=True, kl_coef=0.0)
    assert off.reference_actor is None
    assert all(
        torch.equal(off.actor.state_dict()[k], v) for k, v in module.actor.state_dict().items()
    )


def test_kl_on_a_checkpoint_saved_without_a_reference_is_one_sentence(tmp_path: Path) -> None:
    path = _checkpoint(BraceModule(**TINY), tmp_path / "plain.ckpt")
    with pytest.raises(ValueError) as info:
        BraceModule.load_from_checkpoint(path, weights_only=True, kl_coef=0.05)
    assert str(info.value) == (
        "kl_coef=0.05 needs a checkpoint that holds the reference policy; got one saved with "
        "kl_coef=0 (resume it with kl_coef=0, or start a new run)."
    )


# ---------------------------------------------------------------------- FSDP2 and DDP


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A 1-D data-parallel CPU mesh over a 1-rank gloo group."""
    with one_process_group():
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))


def test_fsdp_shards_the_reference_without_checkpointing_and_copies_the_actor_into_it(
    mesh: DeviceMesh,
) -> None:
    module = BraceModule(
        **TINY, kl_coef=0.1, activation_checkpointing=True, fsdp_meta_init=True, seed=3
    )
    assert all(p.is_meta for p in module.reference_actor.parameters())
    strategy = ModelParallelStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    module._trainer = SimpleNamespace(strategy=strategy)  # type: ignore[assignment]
    module._device_mesh = mesh  # type: ignore[attr-defined]
    module.configure_model()
    reference = module.reference_actor
    assert isinstance(reference, FSDPModule)
    assert all(isinstance(p, DTensor) and not p.is_meta for p in reference.parameters())
    assert any(isinstance(m, CheckpointWrapper) for m in module.actor.modules())
    assert not any(isinstance(m, CheckpointWrapper) for m in reference.modules())
    module.reference.capture(module.actor)
    actor, copied = full_state_dict(module.actor), full_state_dict(reference)
    assert list(copied) == list(actor)
    assert all(torch.equal(copied[k], actor[k]) for k in actor)
    batch = fixed_batch()
    with torch.no_grad():
        want = token_logprobs(module.actor, batch.input_ids, batch.attention_mask)[0]
        got = token_logprobs(reference, batch.input_ids, batch.attention_mask)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
def test_cli_fit_with_the_overlay_logs_kl_to_the_warm_started_policy(tmp_path: Path) -> None:
    cli = run(small_run(tmp_path, *OVERLAY, *WARM_START, "--data.lag=0", steps=3))
    model = cli.model
    assert (model.kl_coef, model.kl_estimator, model.kl_mode) == (0.05, "k3", "loss")
    scalars = read_scalars(cli.trainer.logger.log_dir)
    kl = dict(scalars["kl/ref"])
    assert sorted(kl) == [1, 2, 3]
    assert kl[1] == 0.0  # the reference is the actor as RL starts (after the warm start) ...
    assert kl[2] > 0.0 and kl[3] > 0.0  # ... and the actor has moved away from it since
    assert [step for step, _ in scalars["actor/kl_ref_loss"]] == [1, 2, 3]
    assert all(value >= 0.0 for _, value in scalars["actor/kl_ref_loss"])  # k3 ≥ 0
    assert "kl/ref_penalty" not in scalars
    seed_init = BraceModule(**TINY).actor.state_dict()
    reference = model.reference_actor.state_dict()
    actor = model.actor.state_dict()
    assert any(not torch.equal(reference[k], seed_init[k]) for k in seed_init)  # warm-started
    assert any(not torch.equal(reference[k], actor[k]) for k in actor)  # frozen


@pytest.mark.slow
def test_a_resumed_run_keeps_the_initial_reference_and_equals_the_straight_run(
    tmp_path: Path,
) -> None:
    # As tests/test_trainer.py's resume test: stopped after rollout step 3. The warm start makes the initial policy differ from the model's seed init, and a
    # resumed run skips it: only the checkpoint knows the initial policy.
    common = [
        *OVERLAY,
        *WARM_START,
        "--model.kl_mode=reward",
        "--model.kl_estimator=k1",
        "--model.critic_warmup_steps=1",
        "--model.ppo_epochs=1",
        "--trainer.limit_train_batches=4",
    ]
    straight = run(small_run(tmp_path / "straight", *common, steps=4))
    first = run(
        small_run(
            tmp_path / "first", *common, *stop_and_checkpoint_at(tmp_path / "ckpt", 3), steps=4
        )
    )
    assert first.model.rollout_step == 3
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["brace"]["reference_captured"] is True
    assert any(key.startswith("reference.policy.") for key in saved["state_dict"])
    resumed = run(small_run(tmp_path / "resumed", *common, f"--ckpt_path={checkpoint}", steps=4))
    assert resumed.model.rollout_step == 4

    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    reference = resumed.model.reference_actor.state_dict()
    at_checkpoint = {
        k[len("actor.") :]: v for k, v in saved["state_dict"].items() if k.startswith("actor.")
    }
    assert any(not torch.equal(reference[k], at_checkpoint[k]) for k in reference)
    first_reference = first.model.reference_actor.state_dict()
    assert all(torch.equal(reference[k], first_reference[k]) for k in reference)
    kl_straight = dict(read_scalars(straight.trainer.logger.log_dir)["kl/ref"])
    kl_resumed = dict(read_scalars(resumed.trainer.logger.log_dir)["kl/ref"])
    assert kl_resumed == {4: kl_straight[4]} and kl_straight[4] != 0.0


@pytest.mark.slow
def test_fsdp_shards_the_reference_and_resumes_it_from_a_sharded_checkpoint(
    tmp_path: Path,
) -> None:
    # Two CPU ranks, meta-device construction: the reference is sharded like the actor,
    # allocated empty, filled from the actor's shards at the first step or from the checkpoint.
    recipe = ("fsdp/cpu_2proc.yaml", "objectives/kl_reference.yaml")
    meta = "--model.fsdp_meta_init=true"
    straight = _driver(tmp_path / "straight", *_cli(tmp_path, *recipe), meta)
    assert [r["rank"] for r in straight] == [0, 1] and straight[0]["sharded"]
    assert straight[0]["checksum"] == straight[1]["checksum"]
    kl = [report["last_metrics"]["kl/ref"] for report in straight]
    assert kl[0] > 0.0 and kl[0] == kl[1]  # combined over the ranks
    initial = BraceModule(**TINY).actor.state_dict()
    reference = torch.load(tmp_path / "straight" / "weights.pt", weights_only=True)[
        "reference_actor"
    ]
    for name, value in initial.items():
        torch.testing.assert_close(reference[name], value, rtol=0, atol=0, msg=name)
    ckpt = tmp_path / "ckpt"
    _driver(
        tmp_path / "first",
        *_cli(tmp_path, *recipe),
        meta,
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpt}",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.max_steps=1",
    )
    (checkpoint,) = ckpt.iterdir()
    saved = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    embedding = saved["state_dict.reference.policy.model.embed_tokens.weight"]
    assert len(embedding.chunks) == 2  # one shard per rank, like the actor's
    resumed = _driver(
        tmp_path / "resumed", *_cli(tmp_path, *recipe), meta, f"--ckpt_path={checkpoint}"
    )
    for got, want in zip(resumed, straight, strict=True):
        assert got["checksum"] == want["checksum"]  # actor, critic and reference
        assert got["last_metrics"]["kl/ref"] == want["last_metrics"]["kl/ref"]


@pytest.mark.slow
def test_ddp_ranks_agree_on_the_reference_and_the_reward_penalty(tmp_path: Path) -> None:
    # The quickstart's warm start trains every rank's actor and broadcasts rank 0's: the
    # reference captured from it at the first step is the same on both ranks.
    reports = _driver(
        tmp_path / "run",
        *_cli(tmp_path, "ddp/cpu_2proc.yaml", "objectives/kl_reference.yaml", warm_start=True),
        "--model.kl_mode=reward",
        "--model.kl_estimator=k1",
    )
    first, second = reports
    assert not first["sharded"] and first["checksum"] == second["checksum"]
    assert set(first["checksum"]) == {"actor", "critic", "reference_actor"}
    assert first["checksum"]["reference_actor"] != first["checksum"]["actor"]
    for name in ("kl/ref", "kl/ref_penalty"):
        assert first["last_metrics"][name] == second["last_metrics"][name] != 0.0, name
