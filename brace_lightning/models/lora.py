"""LoRA adapters on the actor (and, as an option, the critic's backbone) through ``peft``.

``peft.inject_adapter_in_model`` replaces each targeted ``nn.Linear`` in place by a LoRA layer
(``base_layer`` frozen, ``lora_A``/``lora_B`` trainable; ``lora_B`` starts at 0, so the adapted model
starts equal to its base): the actor stays a Hugging Face model, every forward, packing and
log-prob path works unchanged, and only the adapters require gradients, so the optimizers built over
``requires_grad`` parameters train only them. The weights leave the trainer merged,
``W = W_base + (alpha / rank) · B A``, under the base model's names (:func:`merged_state_dict`), so
every engine (embedded, vLLM, a producer process) loads plain weights and never sees a peft name.

Simplified on purpose: one adapter named ``"default"``, no dropout, no FSDP2 (the refusal is
:func:`refuse_sharding`); ``peft`` is imported only when LoRA is asked for (``pip install -e
'.[lora]'``). ``docs/lora.md`` has the options and the reference-policy decision.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from brace_lightning.checks import require_bool, require_int
from brace_lightning.models.critic import ValueModel
from brace_lightning.models.policy import load_causal_lm, recompute_nonpersistent_buffers

#: The name peft gives the one adapter (it appears in the parameter names, never outside).
ADAPTER = "default"
#: The adapter folder's files (peft's own layout: ``PeftModel.from_pretrained`` reads them).
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def _require_peft() -> Any:
    """The ``peft`` module, or one sentence with the install hint (a ValueError, so that the CLI
    prints it as its one-line error; the ImportError is its cause)."""
    try:
        import peft
    except ImportError as error:
        raise ValueError(
            "model.lora needs the `peft` package: pip install -e '.[lora]' (or pip install "
            "'peft>=0.21'), or leave model.lora unset."
        ) from error
    return peft


@dataclass
class LoraSettings:
    """LoRA adapters of the actor (``--model.lora.rank 8 --model.lora.alpha 16``).

    Args:
        rank: the adapters' rank r (``lora_A``: ``[r, in]``, ``lora_B``: ``[out, r]``).
        alpha: the scale numerator: a layer computes ``W x + (alpha / rank) · B A x``.
        target_modules: ``"all-linear"`` (every linear layer but the LM head) or module names
            such as ``["q_proj", "v_proj"]`` (peft's ``target_modules``).
        critic: also put adapters (same settings) on the critic's backbone; its value head
            stays fully trained.
    """

    rank: int = 8
    alpha: float = 16.0
    target_modules: str | list[str] = "all-linear"
    critic: bool = False

    def __post_init__(self) -> None:
        require_int("lora.rank", self.rank, 1)
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
            raise ValueError(f"lora.alpha must be a number > 0; got {alpha!r}.")
        self.alpha = float(alpha)
        targets = self.target_modules
        if isinstance(targets, tuple):
            targets = self.target_modules = list(targets)
        if not (
            (isinstance(targets, str) and targets)
            or (
                isinstance(targets, list)
                and targets
                and all(isinstance(t, str) and t for t in targets)
            )
        ):
            raise ValueError(
                "lora.target_modules must be 'all-linear' or a non-empty list of module names; "
                f"got {targets!r}."
            )
        require_bool("lora.critic", self.critic)

    @classmethod
    def coerce(cls, value: LoraSettings | dict[str, Any] | None) -> LoraSettings | None:
        """``value`` as settings: None (no LoRA), the settings, or their saved dictionary."""
        if value is None or isinstance(value, LoraSettings):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"lora must be None, a LoraSettings or a dictionary of its fields; got {value!r}."
            )
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint's hyperparameters (read back by :meth:`coerce`)."""
        return asdict(self)

    def peft_config(self, *, base_model: str | None = None) -> Any:
        """peft's ``LoraConfig`` of these settings (no dropout, no bias adapters)."""
        peft = _require_peft()
        return peft.LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=self.target_modules,
            lora_dropout=0.0,
            bias="none",
            base_model_name_or_path=base_model,
        )


def add_adapters(model: nn.Module, settings: LoraSettings, *, seed: int) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place (and return it); ``lora_A`` is drawn from
    ``seed`` (the global random state is left untouched), ``lora_B`` is 0. Afterwards only the
    adapters require gradients.

    Raises:
        ValueError: ``settings.target_modules`` names no module of ``model``.
    """
    peft = _require_peft()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            peft.inject_adapter_in_model(settings.peft_config(), model, adapter_name=ADAPTER)
        except ValueError as error:
            raise ValueError(
                f"lora.target_modules={settings.target_modules!r} matches no module of "
                f"{type(model).__name__}; expected 'all-linear' or names of its linear layers "
                f"({error})."
            ) from error
    return model


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA layers (built with :func:`add_adapters`)."""
    return any(".lora_A." in name for name, _ in model.named_parameters())


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    peft = _require_peft()
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer)
    }


@torch.no_grad()
def merged_state_dict(model: nn.Module, *, adapters: bool = True) -> dict[str, torch.Tensor]:
    """``model``'s state dict with the base model's names and merged weights.

    A LoRA layer's ``<name>.base_layer.weight`` becomes ``<name>.weight`` = base + (alpha/r)·B A
    (a new tensor, in the base weight's dtype; with ``adapters=False`` the base weight itself);
    ``<name>.base_layer.bias`` becomes ``<name>.bias``; the ``lora_A``/``lora_B`` tensors are left
    out. Every other tensor is the model's own (no copy). A model without adapters gives its own
    ``state_dict()``.
    """
    state = model.state_dict()
    if not has_adapters(model):
        return state
    layers = _lora_layers(model)
    merged: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        owner, _, leaf = key.rpartition(".base_layer.")
        if not owner:
            merged[key] = tensor
            continue
        if leaf == "weight" and adapters:
            delta = layers[owner].get_delta_weight(ADAPTER)
            tensor = tensor + delta.to(tensor.dtype)
        merged[f"{owner}.{leaf}"] = tensor
    return merged


@torch.no_grad()
def load_base_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` (plain names, e.g. another model's :func:`merged_state_dict`) into
    ``model``: with adapters into their ``base_layer`` weights, the adapters left as they are;
    without, ``model.load_state_dict(state)`` (strict in both cases).

    Raises:
        ValueError: ``state``'s names differ from ``model``'s plain names.
    """
    if not has_adapters(model):
        model.load_state_dict(state)
        return
    targets = {
        key.replace(".base_layer.", "."): tensor
        for key, tensor in model.state_dict().items()
        if ".lora_A." not in key and ".lora_B." not in key
    }
    if set(targets) != set(state):
        raise ValueError(
            f"load_base_weights got {len(state)} tensors for {type(model).__name__}'s "
            f"{len(targets)} base weights ({len(set(targets) ^ set(state))} names differ); "
            "expected the state dict of the same architecture."
        )
    for name, tensor in targets.items():
        tensor.copy_(state[name])


def merged_copy(model: PreTrainedModel, *, adapters: bool = True) -> PreTrainedModel:
    """A plain model of ``model``'s config (no peft layers) holding its merged weights (with
    ``adapters=False`` its base weights), on its device and in eval mode: what the engines
    generate with and ``export`` writes."""
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    with torch.device("meta"):
        plain = load_causal_lm(copy.deepcopy(model.config), dtype=dtype, seed=0)
    merged = merged_state_dict(model, adapters=adapters)
    plain.load_state_dict({k: v.detach().clone() for k, v in merged.items()}, assign=True)
    plain.tie_weights()
    recompute_nonpersistent_buffers(plain, device)
    return plain.eval()


def merged_critic_copy(critic: ValueModel) -> ValueModel:
    """A plain critic (no peft layers in its backbone) holding ``critic``'s merged weights."""
    with torch.device("meta"):
        plain = ValueModel.from_config(copy.deepcopy(critic.config), seed=0)
    device = next(critic.parameters()).device
    state = {k: v.detach().clone() for k, v in merged_state_dict(critic).items()}
    plain.load_state_dict(state, assign=True)
    recompute_nonpersistent_buffers(plain.backbone, device)
    return plain.train(critic.training)


def save_adapter(
    model: nn.Module, settings: LoraSettings, folder: str | Path, *, base_model: str | None
) -> Path:
    """Write ``model``'s adapter as peft does (``adapter_config.json``,
    ``adapter_model.safetensors``), for ``PeftModel.from_pretrained(base, folder)``."""
    peft = _require_peft()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = peft.get_peft_model_state_dict(model, adapter_name=ADAPTER)
    # PeftModel's own prefix: its base model sits under base_model.model.
    save_file(
        {f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in weights.items()},
        str(folder / ADAPTER_WEIGHTS_FILE),
    )
    config = settings.peft_config(base_model=base_model)
    config.task_type = "CAUSAL_LM"
    (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    return folder


def refuse_sharding(actor: nn.Module, critic: nn.Module | None) -> None:
    """One sentence when LoRA meets FSDP2 (not supported: the merge needs full weights); ``critic``
    None in a critic-free run."""
    if has_adapters(actor) or (critic is not None and has_adapters(critic)):
        raise ValueError(
            "model.lora is not supported with ModelParallelStrategy (FSDP2); use strategy "
            "'ddp' or 'auto', or leave model.lora unset."
        )
