"""The actor and the critic of a run, built whole or, for FSDP2's meta-device init, empty.

Three cases (``docs/fsdp.md``):

- the usual one: the actor loaded (or the tiny model built from ``seed``) and the critic built from
  it (its backbone copied with ``critic_from_actor``, its value head drawn from ``seed + 1``), or
  no critic at all for a critic-free value target (``with_critic=False``: GRPO, Dr. GRPO, RLOO);
- ``fsdp_meta_init`` with a checkpoint folder: both on the meta device; ``configure_model`` later
  reads each rank's shards from the folder's safetensors (nothing is read here);
- ``fsdp_meta_init`` with a random model: built as usual, its full state kept, then both replaced by
  meta-device models, so that the sharded run starts from exactly the usual construction's values.

With ``lora`` (``models/lora.py``) the actor, and with ``lora.critic`` the critic's backbone, get
adapters after the critic is built (so the critic copies the plain backbone); LoRA is refused with
``fsdp_meta_init`` and with FSDP2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig, PreTrainedTokenizerBase

from brace_lightning.models.critic import ValueModel, critic_seed
from brace_lightning.models.lora import LoraSettings, add_adapters, refuse_sharding
from brace_lightning.models.meta_init import empty_models, materialise_and_fill
from brace_lightning.models.parallelize import (
    checkpoint_activations,
    mixed_precision_dtypes,
    parallelize,
)
from brace_lightning.models.policy import recompute_nonpersistent_buffers
from brace_lightning.models.sources import TINY, load_actor


@dataclass
class MetaFill:
    """What ``configure_model`` fills meta-built models from: a checkpoint ``folder`` or the full
    ``states`` (actor, critic) of a random model; ``seed`` draws the critic's value head."""

    folder: str | None
    states: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None
    seed: int

    def fill(self, actor: nn.Module, critic: ValueModel, device: torch.device) -> None:
        """Allocate this rank's shards of the sharded ``actor`` and ``critic`` and fill them."""
        materialise_and_fill(
            actor, critic, device, folder=self.folder, states=self.states, seed=self.seed
        )
        self.states = None  # the full copies are no longer needed


def build_actor_critic(
    actor: str,
    *,
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int,
    num_layers: int,
    seed: int,
    critic_from_actor: bool,
    meta_init: bool,
    lora: LoraSettings | dict[str, Any] | None = None,
    with_critic: bool = True,
) -> tuple[nn.Module, ValueModel | None, MetaFill | None]:
    """``(actor, critic, meta)``: the models in training mode (critic None without
    ``with_critic``), and with ``meta_init`` what ``configure_model`` fills them from (else None).
    ``lora`` (settings or their saved dict) adds adapters whose ``lora_A`` is drawn from ``seed``
    (actor) and ``seed + 1`` (critic)."""
    lora = LoraSettings.coerce(lora)
    if lora is not None and meta_init:
        raise ValueError(
            "model.lora is not supported with fsdp_meta_init=True (FSDP2); set one of them off."
        )
    if not with_critic:
        if meta_init:
            raise ValueError(
                "fsdp_meta_init=True needs a critic-based value_target (GAE, VTrace, BRACE); got a "
                "critic-free one: set fsdp_meta_init=False, FSDP2 then shards the actor as built."
            )
        policy = load_actor(
            actor, tokenizer=tokenizer, hidden_size=hidden_size, num_layers=num_layers, seed=seed
        )
        if lora is not None:
            add_adapters(policy, lora, seed=seed)
        return policy.train(), None, None
    if meta_init and actor != TINY:  # a checkpoint folder: nothing is read here
        policy, critic = empty_models(AutoConfig.from_pretrained(actor))
        return policy, critic, MetaFill(actor, None, critic_seed(seed))
    policy = load_actor(
        actor, tokenizer=tokenizer, hidden_size=hidden_size, num_layers=num_layers, seed=seed
    )
    critic = ValueModel.from_actor(policy, copy_weights=critic_from_actor, seed=critic_seed(seed))
    if lora is not None:
        add_adapters(policy, lora, seed=seed)
        if lora.critic:
            add_adapters(critic.backbone, lora, seed=critic_seed(seed))
    meta = None
    if meta_init:  # random: the usual construction's exact values, sliced later
        meta = MetaFill(None, (policy.state_dict(), critic.state_dict()), critic_seed(seed))
        policy, critic = empty_models(policy.config)
    # loaders return eval mode; Lightning expects training mode at fit start
    return policy.train(), critic.train(), meta


def refuse_meta_init_without_fsdp(trainer: Any, meta_init: bool) -> None:
    """One sentence when ``meta_init`` (``fsdp_meta_init``) meets a ``trainer`` whose strategy is
    not FSDP2's ``ModelParallelStrategy`` (the caller checked that; None: not attached yet)."""
    if trainer is not None and meta_init:
        raise ValueError(
            "fsdp_meta_init=True needs trainer.strategy ModelParallelStrategy (FSDP2); got "
            f"{type(trainer.strategy).__name__}."
        )


def checkpoint_actor_critic(actor: nn.Module, critic: ValueModel | None) -> None:
    """Activation checkpointing of each transformer block of ``actor`` and ``critic`` (if any)."""
    for model in (actor, critic):
        if model is not None:
            checkpoint_activations(model)


def shard_actor_critic(
    actor: nn.Module,
    critic: ValueModel | None,
    reference: nn.Module | None,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    meta: MetaFill | None,
    activation_checkpointing: bool,
    mixed_precision: str,
    cpu_offload: bool,
) -> None:
    """FSDP2 for the actor, the critic and the frozen ``reference`` policy (sharded like the actor,
    so that capturing it copies shard to shard; no activation checkpointing: no backward), then
    meta-built models allocated and filled from ``meta`` (the reference only allocated: its values
    come from the actor at the first step, or from the checkpoint) on this rank's ``device``; a
    critic-free run (``critic`` None) is never meta-built (:func:`build_actor_critic`). LoRA models
    are refused (one sentence)."""
    refuse_sharding(actor, critic)
    param_dtype, reduce_dtype = mixed_precision_dtypes(mixed_precision, mesh.device_type)
    policy = dict(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cpu_offload=cpu_offload)
    for model in (actor, critic):
        if model is not None:
            parallelize(model, mesh, activation_checkpointing=activation_checkpointing, **policy)
    if reference is not None:
        parallelize(reference, mesh, **policy)
    if any(p.is_meta for p in actor.parameters()):
        assert meta is not None and critic is not None  # meta-built only with fsdp_meta_init
        meta.fill(actor, critic, device)
    if reference is not None and any(p.is_meta for p in reference.parameters()):
        reference.to_empty(device=device)
        recompute_nonpersistent_buffers(reference, device)
