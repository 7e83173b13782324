"""LoRA adapters (``models/lora.py``): only adapters train, engines and exports get merged weights
under the base model's names, checkpoints resume, FSDP2 is refused, a missing peft is one sentence.

The merge ``W + (alpha / r) · B A`` is checked against a float64 product written out here.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModelForCausalLM

from brace_lightning.cli import run
from brace_lightning.data import PublishTarget
from brace_lightning.export import (
    ADAPTER_FOLDER,
    ExportOnFitEnd,
    export_checkpoint,
    load_exported_critic,
)
from brace_lightning.logs import read_scalars
from brace_lightning.models.lora import (
    LoraSettings,
    add_adapters,
    has_adapters,
    load_base_weights,
    merged_state_dict,
)
from brace_lightning.models.policy import token_logprobs
from brace_lightning.models.sources import load_actor, load_tokenizer
from brace_lightning.module import BraceModule
from brace_lightning.objectives import PPOEWMA
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.warmstart import copy_backbone_to_critic
from tests.test_kl_reference import OneBatch, fixed_batch, mesh  # noqa: F401 (fixture)
from tests.test_parallel import _assert_ranks_agree, _cli, _driver
from tests.test_trainer import CONFIGS, small_run

TINY: dict[str, Any] = {"tiny_hidden_size": 32, "tiny_num_layers": 1, "seed": 0}
LORA = LoraSettings(rank=4, alpha=8.0)


class Recording(PublishTarget, OneBatch):
    """The same rollout batch every step; keeps a copy of every published state dict."""

    def __init__(self, batch: RolloutBatch) -> None:
        super().__init__(batch)
        self.published: list[dict[str, torch.Tensor]] = []

    def publish(self, buckets: Any, version: int) -> None:
        state: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            state |= {k: v.detach().clone() for k, v in bucket.items()}
        self.published.append(state)


def lora_module(lora: LoraSettings = LORA, **kwargs: Any) -> BraceModule:
    """A tiny LoRA module whose networks take plain SGD steps (the adapters move visibly)."""
    return BraceModule(
        **TINY,
        critic_warmup_steps=0,
        max_grad_norm=None,
        actor_optimizer=functools.partial(torch.optim.SGD, lr=1.0),
        critic_optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        lora=lora,
        **kwargs,
    )


def trainer(steps: int, epochs: int = 1, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_train_batches=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@pytest.fixture(scope="module")
def trained() -> tuple[BraceModule, Recording, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA module (critic adapters too) after two SGD steps: module, data, weights before."""
    module = lora_module(LoraSettings(rank=4, alpha=8.0, critic=True))
    before_actor, before_critic = snapshot(module.actor), snapshot(module.critic)
    data = Recording(fixed_batch())
    trainer(2).fit(module, datamodule=data)
    return module, data, before_actor, before_critic


def test_only_adapter_parameters_change_after_training_steps(trained) -> None:
    module, _, before_actor, before_critic = trained
    after_actor, after_critic = snapshot(module.actor), snapshot(module.critic)
    for name, value in before_actor.items():
        moved = not torch.equal(value, after_actor[name])
        assert moved == _is_adapter(name), name  # both A and B move after two steps
    for name, value in before_critic.items():  # lora_A moves below float32's step here
        moved = not torch.equal(value, after_critic[name])
        if ".lora_A." not in name:
            assert moved == (_is_adapter(name) or name.startswith("value_head.")), name
    actor_opt, critic_opt = module.trainer.optimizers
    trainable = [p for p in module.actor.parameters() if p.requires_grad]
    assert actor_opt.param_groups[0]["params"] == trainable
    assert len(trainable) == sum(_is_adapter(n) for n, _ in module.actor.named_parameters())
    assert len(critic_opt.param_groups[0]["params"]) == len(trainable) + 2  # + value head


def test_without_lora_every_parameter_trains_and_nothing_is_injected() -> None:
    module = BraceModule(**TINY)
    assert not has_adapters(module.actor) and not has_adapters(module.critic)
    assert all(p.requires_grad for p in module.actor.parameters())
    assert module.hparams["lora"] is None


def test_published_buckets_have_the_base_names_and_equal_the_merged_weights(trained) -> None:
    module, data, _, _ = trained
    plain = load_actor("tiny-char", tokenizer=load_tokenizer("tiny-char"), **SIZES).state_dict()
    assert len(data.published) == 2
    published = data.published[-1]
    assert set(published) == set(plain)
    state = module.actor.state_dict()
    merged_layers = 0
    for name, tensor in published.items():
        owner, _, leaf = name.rpartition(".")
        if f"{owner}.lora_A.default.weight" not in state:
            want = state[name].double()
        elif leaf == "bias":
            want = state[f"{owner}.base_layer.bias"].double()
        else:  # float64 reference: W + (alpha / r) · B A
            a = state[f"{owner}.lora_A.default.weight"].double()
            b = state[f"{owner}.lora_B.default.weight"].double()
            want = state[f"{owner}.base_layer.weight"].double() + (8.0 / 4) * b @ a
            merged_layers += 1
        torch.testing.assert_close(tensor.double(), want, rtol=0, atol=1e-6, msg=name)
    assert merged_layers == 7  # q, k, v, o, gate, up, down of the one layer
    assert any(
        not torch.equal(published[n], state[n.replace(".weight", ".base_layer.weight")])
        for n in published
        if n.replace(".weight", ".base_layer.weight") in state
    )


SIZES = {"hidden_size": 32, "num_layers": 1}


def test_lora_logprobs_equal_the_merged_engine_models(trained) -> None:
    module, _, _, _ = trained
    engine = module.handoff.engine_model()
    assert not has_adapters(engine) and engine is not module.actor
    batch = fixed_batch()
    with torch.no_grad():
        lora = token_logprobs(module.actor.eval(), batch.input_ids, batch.attention_mask)[0]
        merged = token_logprobs(engine, batch.input_ids, batch.attention_mask)[0]
    torch.testing.assert_close(merged, lora, rtol=0, atol=1e-6)
    assert float((lora - token_logprobs_of_base(module, batch)).abs().max()) > 1e-4


def token_logprobs_of_base(module: BraceModule, batch: RolloutBatch) -> torch.Tensor:
    """Log-probs of the untouched base (adapters off): the adapters did change the policy."""
    base = load_actor("tiny-char", tokenizer=module.tokenizer, seed=0, **SIZES).eval()
    with torch.no_grad():
        return token_logprobs(base, batch.input_ids, batch.attention_mask)[0]


def test_the_kl_reference_and_ewma_copies_run_with_a_lora_actor() -> None:
    """The reference is a copy of the LoRA actor as RL starts (base + adapters): KL 0 at step 1."""
    module = lora_module(kl_coef=0.1, kl_estimator="k1")
    trainer(2).fit(module, datamodule=OneBatch(fixed_batch()))
    reference = module.reference_actor
    assert has_adapters(reference) and not any(p.requires_grad for p in reference.parameters())
    assert any(
        not torch.equal(v, module.actor.state_dict()[k])
        for k, v in reference.state_dict().items()
        if _is_adapter(k)
    )
    ewma = lora_module(actor_objective=PPOEWMA())
    trainer(2).fit(ewma, datamodule=OneBatch(fixed_batch()))
    assert int(ewma.ewma.steps) == 2


def _save(module: BraceModule, fit: pl.Trainer, path: Path) -> Path:
    fit.save_checkpoint(path)
    return path


def test_a_lora_checkpoint_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    # Lightning reads the checkpoint with weights_only: the default AdamW, not SGD partials.
    def module() -> BraceModule:
        return BraceModule(**TINY, critic_warmup_steps=0, lora=LORA)

    straight = module()
    trainer(2, epochs=2).fit(straight, datamodule=OneBatch(fixed_batch()))
    first, fit = module(), trainer(2)
    fit.fit(first, datamodule=OneBatch(fixed_batch()))
    path = _save(first, fit, tmp_path / "lora.ckpt")
    resumed = module()
    trainer(2, epochs=2).fit(resumed, datamodule=OneBatch(fixed_batch()), ckpt_path=path)
    assert resumed.rollout_step == straight.rollout_step == 4
    want, got, half = snapshot(straight.actor), snapshot(resumed.actor), snapshot(first.actor)
    assert list(want) == list(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert any(not torch.equal(want[k], half[k]) for k in want if ".lora_B." in k)
    loaded = BraceModule.load_from_checkpoint(path, weights_only=True)
    assert loaded.hparams["lora"] == {
        "rank": 4,
        "alpha": 8.0,
        "target_modules": "all-linear",
        "critic": False,
    }
    assert has_adapters(loaded.actor) and not has_adapters(loaded.critic)
    assert torch.equal(loaded.actor.state_dict()[k := next(iter(half))], half[k])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, trained) -> Path:
    """The trained weights in a module whose hyperparameters a weights_only read accepts."""
    module = BraceModule(**TINY, lora=LoraSettings(rank=4, alpha=8.0, critic=True))
    module.load_state_dict(trained[0].state_dict())
    fit = trainer(1)
    fit.strategy.connect(module)
    return _save(module, fit, tmp_path_factory.mktemp("ckpt") / "lora.ckpt")


def test_export_merged_loads_in_transformers_and_gives_the_same_logits(
    trained, checkpoint: Path, tmp_path: Path
) -> None:
    module = trained[0]
    out = export_checkpoint(checkpoint, tmp_path / "out")
    actor = AutoModelForCausalLM.from_pretrained(out / "actor")
    assert not has_adapters(actor)
    batch = fixed_batch()
    with torch.no_grad():
        want = module.actor.eval()(batch.input_ids, attention_mask=batch.attention_mask).logits
        got = actor(batch.input_ids, attention_mask=batch.attention_mask).logits
        critic = load_exported_critic(out / "critic")
        values = critic(batch.input_ids, batch.attention_mask)
        want_values = module.critic.eval()(batch.input_ids, batch.attention_mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-5)
    assert not (out / ADAPTER_FOLDER).exists()


def test_export_as_adapter_loads_with_peft_and_gives_the_same_logits(
    trained, checkpoint: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    module = trained[0]
    out = export_checkpoint(checkpoint, tmp_path / "out", adapter=True)
    base = AutoModelForCausalLM.from_pretrained(out / "actor")
    batch = fixed_batch()
    with torch.no_grad():
        base_logits = base(batch.input_ids, attention_mask=batch.attention_mask).logits
        adapted = PeftModel.from_pretrained(base, out / ADAPTER_FOLDER).eval()
        got = adapted(batch.input_ids, attention_mask=batch.attention_mask).logits
        want = module.actor.eval()(batch.input_ids, attention_mask=batch.attention_mask).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert float((base_logits - want).abs().max()) > 1e-3  # the base alone is another policy


def test_export_as_adapter_of_a_run_without_lora_is_one_sentence(tmp_path: Path) -> None:
    module = BraceModule(**TINY)
    fit = trainer(1)
    fit.strategy.connect(module)
    path = _save(module, fit, tmp_path / "plain.ckpt")
    with pytest.raises(ValueError) as info:
        export_checkpoint(path, tmp_path / "out", adapter=True)
    assert str(info.value) == (
        "adapter=True needs the checkpoint of a LoRA run (model.lora set); "
        f"ckpt_path={str(path)!r} has none."
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "lora.rank must be an integer >= 1; got 0."),
        ({"rank": 2.5}, "lora.rank must be an integer >= 1; got 2.5."),
        ({"alpha": 0}, "lora.alpha must be a number > 0; got 0."),
        ({"target_modules": []}, "lora.target_modules must be 'all-linear' or a non-empty list"),
        ({"critic": "yes"}, "lora.critic must be a bool; got 'yes'."),
    ],
)
def test_bad_lora_settings_are_one_sentence(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace(".", r"\.").replace("(", r"\(")):
        LoraSettings(**kwargs)


def test_target_modules_that_match_nothing_are_one_sentence() -> None:
    actor = load_actor("tiny-char", tokenizer=load_tokenizer("tiny-char"), **SIZES)
    with pytest.raises(ValueError, match=r"^lora\.target_modules=\['nope'\] matches no module"):
        add_adapters(actor, LoraSettings(target_modules=["nope"]), seed=0)


def test_target_modules_choose_the_adapted_layers() -> None:
    module = BraceModule(**TINY, lora=LoraSettings(target_modules=["q_proj", "v_proj"]))
    adapted = {n.split(".")[-4] for n, _ in module.actor.named_parameters() if _is_adapter(n)}
    assert adapted == {"q_proj", "v_proj"}
    scaled = BraceModule(**TINY, lora=LoraSettings(rank=2, alpha=6.0))
    layer = scaled.actor.model.layers[0].self_attn.q_proj
    assert layer.lora_A["default"].weight.shape[0] == 2 and layer.scaling["default"] == 3.0


def test_a_missing_peft_is_one_sentence_with_the_install_hint(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ValueError) as info:
        BraceModule(**TINY, lora=LORA)
    assert isinstance(info.value.__cause__, ImportError)
    assert str(info.value) == (
        "model.lora needs the `peft` package: pip install -e '.[lora]' (or pip install "
        "'peft>=0.21'), or leave model.lora unset."
    )
    assert BraceModule(**TINY).actor is not None  # without LoRA peft is never imported


def test_a_missing_peft_on_the_command_line_is_one_error_line(
    monkeypatch, tmp_path: Path, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(SystemExit) as info:
        run(small_run(tmp_path, "--config", str(CONFIGS / "lora.yaml")))
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: model.lora needs the `peft` package: pip install -e '.[lora]' (or pip install "
        "'peft>=0.21'), or leave model.lora unset. (import of peft halted; None in sys.modules)"
    )


def test_fsdp2_and_its_meta_init_refuse_lora_in_one_sentence(mesh: DeviceMesh) -> None:  # noqa: F811
    with pytest.raises(ValueError) as info:
        BraceModule(**TINY, lora=LORA, fsdp_meta_init=True)
    assert str(info.value) == (
        "model.lora is not supported with fsdp_meta_init=True (FSDP2); set one of them off."
    )
    module = BraceModule(**TINY, lora=LORA)
    strategy = ModelParallelStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    module._trainer = SimpleNamespace(strategy=strategy)  # type: ignore[assignment]
    module._device_mesh = mesh  # type: ignore[attr-defined]
    with pytest.raises(ValueError) as info:
        module.configure_model()
    assert str(info.value) == (
        "model.lora is not supported with ModelParallelStrategy (FSDP2); use strategy 'ddp' or "
        "'auto', or leave model.lora unset."
    )


def test_the_cli_takes_lora_options_and_the_overlay_parses(tmp_path: Path) -> None:
    args = small_run(tmp_path, "--config", str(CONFIGS / "lora.yaml"), "--model.lora.rank=2")
    cli = run(args[1:], run=False)
    assert cli.model.hparams["lora"]["rank"] == 2
    assert has_adapters(cli.model.actor) and not has_adapters(cli.model.critic)
    critic = run([*args[1:], "--model.lora.critic=true"], run=False)
    assert has_adapters(critic.model.critic)


@pytest.mark.slow
def test_cli_fit_with_the_lora_overlay_trains_only_adapters_and_exports(tmp_path: Path) -> None:
    cli = run(small_run(tmp_path, "--config", str(CONFIGS / "lora.yaml"), steps=3))
    assert cli.model.policy_version == 3
    fresh = run(
        small_run(tmp_path / "fresh", "--config", str(CONFIGS / "lora.yaml"))[1:], run=False
    )
    before, after = snapshot(fresh.model.actor), snapshot(cli.model.actor)
    assert all(torch.equal(before[k], after[k]) != _is_adapter(k) for k in before)
    (ckpt,) = Path(tmp_path).rglob("*.ckpt")
    out = export_checkpoint(ckpt, tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(out / "actor")
    ids = torch.tensor([cli.model.tokenizer("7+1=")["input_ids"]])
    with torch.no_grad():
        want = cli.model.actor.eval()(ids).logits
        torch.testing.assert_close(exported(ids).logits, want, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_ddp_with_lora_ranks_agree(tmp_path: Path) -> None:
    reports = _driver(tmp_path / "run", *_cli(tmp_path, "ddp/cpu_2proc.yaml", "lora.yaml", steps=2))
    _assert_ranks_agree(reports)
    assert reports[0]["policy_version"] == 2


@pytest.mark.parametrize("critic", [False, True])
def test_the_warm_start_copies_the_merged_actor_backbone_into_the_critic(critic: bool) -> None:
    module = BraceModule(**TINY, lora=LoraSettings(rank=4, alpha=8.0, critic=critic))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in module.actor.named_parameters():
            if ".lora_B." in name:  # as if the warm start had trained the adapters
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    copy_backbone_to_critic(module.actor, module.critic, seed=1)
    want = merged_state_dict(module.actor.base_model)
    got = merged_state_dict(module.critic.backbone)
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert has_adapters(module.critic.backbone) == critic
    with pytest.raises(ValueError, match="^load_base_weights got 1 tensors for"):
        load_base_weights(module.actor, {"lm_head.weight": module.actor.lm_head.weight})


def test_export_on_fit_end_writes_merged_weights(tmp_path: Path) -> None:
    module = lora_module()
    fit = trainer(1, callbacks=[ExportOnFitEnd(str(tmp_path / "out"))])
    fit.fit(module, datamodule=OneBatch(fixed_batch()))
    actor = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "actor")
    assert not has_adapters(actor)
    batch = fixed_batch()
    with torch.no_grad():
        want = module.actor.eval()(batch.input_ids, attention_mask=batch.attention_mask).logits
        got = actor(batch.input_ids, attention_mask=batch.attention_mask).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_async_producer_process_samples_with_the_merged_weights(tmp_path: Path) -> None:
    """The producer rebuilds a plain model from the config and loads the published merged
    weights into shared-memory slots by the base names; at max_staleness 0 every trained sample
    was generated by the current policy, so µ equals the LoRA actor's π at the step start."""
    overlays = ("--config", str(CONFIGS / "async.yaml"), "--config", str(CONFIGS / "lora.yaml"))
    cli = run(small_run(tmp_path, *overlays, "--data.max_staleness=0", "--data.lag=0", steps=3))
    assert cli.model.policy_version == 3
    scalars = read_scalars(next(Path(tmp_path).rglob("events.out.tfevents.*")).parent)
    assert len(scalars["rollout/reward"]) == 3
    # KL(µ‖π) ≈ 0: the engine's log-probs come from the merged weights of the current version.
    kl = [value for _, value in scalars["kl/mu_pi_k3"]]
    assert len(kl) == 3 and max(kl) < 1e-4, kl
