"""The critic: a causal-LM backbone with a scalar value head, one value per token position.

``values[b, t]`` is the value of the prefix ending at column t, i.e. of the state in which the token
at column t + 1 is chosen. The module that trains the critic reads V(state before action t) at
column t − 1 (see ``rollout/types.py``); this class only produces the per-position values.

The critic has its own weights. :meth:`ValueModel.from_actor` starts them as a copy of the actor's
backbone (the usual PPO-for-LLMs initialisation); :meth:`ValueModel.from_config` starts from random
weights. The head is a ``Linear(hidden, 1)`` kept in float32 with a small initialisation so that
initial values are near 0 whatever the backbone's scale (:func:`init_value_head`, the one place that
draws it; the sharded and the warm-started critics draw it there too). A run's critic is seeded
with :func:`critic_seed` of the run's seed.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModel, PretrainedConfig, PreTrainedModel

from brace_lightning.models.policy import (
    position_ids_from_attention_mask,
    recompute_nonpersistent_buffers,
)


def critic_seed(seed: int) -> int:
    """The seed of a run's critic (its random backbone and value head) from the run's ``seed``:
    ``seed + 1``, so that actor and critic built from one run seed do not draw the same numbers."""
    return seed + 1


@torch.no_grad()
def init_value_head(
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    std: float,
    generator: torch.Generator | None = None,
) -> None:
    """The value head's initialisation, in place: ``weight ~ N(0, std²)`` elementwise, ``bias = 0``.

    Draws ``weight.numel()`` normals from ``generator``, or from the global generator of
    ``weight``'s device when None (a meta tensor draws nothing).

    Args:
        weight: ``[1, H]`` the head's weight (or a full-size tensor to be sliced into shards).
        bias: ``[1]`` the head's bias.
        std: standard deviation of the weights (``head_init_std``).
        generator: the source of the draw; None = the global one.
    """
    weight.normal_(0.0, std, generator=generator)
    bias.zero_()


class ValueModel(nn.Module):
    """A base-model backbone (``AutoModel``, no LM head) plus ``value_head: Linear(hidden, 1)``.

    Args:
        backbone: a Hugging Face base model returning ``last_hidden_state`` ``[B, T, H]``.
        head_init_std: standard deviation of the value head's initial weights (bias starts at 0).
    """

    def __init__(self, backbone: PreTrainedModel, *, head_init_std: float = 1e-3) -> None:
        super().__init__()
        if head_init_std < 0:
            raise ValueError(
                f"ValueModel got head_init_std={head_init_std}; expected a value >= 0."
            )
        self.backbone = backbone
        hidden_size = backbone.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        init_value_head(self.value_head.weight, self.value_head.bias, std=head_init_std)

    @property
    def config(self) -> PretrainedConfig:
        """The backbone's config."""
        return self.backbone.config

    @classmethod
    def from_config(
        cls,
        config: PretrainedConfig,
        *,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
        head_init_std: float = 1e-3,
    ) -> ValueModel:
        """A randomly initialised critic with the architecture of ``config``.

        Args:
            config: a causal-LM config (``AutoModel`` picks the matching base model).
            dtype: backbone dtype; None = library default (float32). The head stays float32.
            seed: seed of the random initialisation (the global RNG is left untouched).
            head_init_std: see :class:`ValueModel`.
        """
        kwargs = {} if dtype is None else {"dtype": dtype}
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            backbone = AutoModel.from_config(config, **kwargs)
            return cls(backbone, head_init_std=head_init_std)

    @classmethod
    def from_pretrained(
        cls,
        source: str,
        *,
        dtype: torch.dtype | str | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
        head_init_std: float = 1e-3,
    ) -> ValueModel:
        """A critic whose backbone is loaded from a checkpoint (local folder or hub name).

        The LM head of a causal-LM checkpoint is dropped (``AutoModel`` loads the base model); the
        value head is freshly initialised.
        """
        kwargs: dict[str, object] = {"revision": revision, "trust_remote_code": trust_remote_code}
        if dtype is not None:
            kwargs["dtype"] = dtype
        backbone = AutoModel.from_pretrained(source, **kwargs)
        return cls(backbone, head_init_std=head_init_std)

    @classmethod
    def from_actor(
        cls,
        actor: PreTrainedModel,
        *,
        copy_weights: bool = True,
        seed: int | None = None,
        head_init_std: float = 1e-3,
    ) -> ValueModel:
        """A critic with the actor's architecture.

        Args:
            actor: a Hugging Face causal LM (``actor.base_model`` is its backbone).
            copy_weights: True starts the backbone with clones of the actor's backbone tensors
                (separate storage, same values; no ``deepcopy``, which FSDP modules refuse); False initialises it randomly from ``actor.config``.
            seed: seed of the random initialisation when ``copy_weights`` is False, and of the head.
            head_init_std: see :class:`ValueModel`.
        """
        if not isinstance(actor, PreTrainedModel):
            raise ValueError(
                f"ValueModel.from_actor got actor of type {type(actor).__name__}; expected a "
                "transformers PreTrainedModel (unwrap FSDP/DDP/compile first)."
            )
        if not copy_weights:
            dtype = next(actor.parameters()).dtype
            return cls.from_config(
                actor.config, dtype=dtype, seed=seed, head_init_std=head_init_std
            )
        state = actor.base_model.state_dict()
        if any(isinstance(tensor, DTensor) for tensor in state.values()):
            raise ValueError(
                "ValueModel.from_actor got an FSDP-sharded actor; expected an unsharded one (a "
                "sharded critic is read from the actor's checkpoint: "
                "brace_lightning.models.meta_init.load_sharded_critic)."
            )
        # The backbone's parameters are created on the meta device (no memory, no random init),
        # then replaced by clones of the actor's; non-persistent buffers (rotary frequencies) are
        # not in the state dict and are rebuilt from the config.
        with torch.device("meta"):
            backbone = AutoModel.from_config(copy.deepcopy(actor.config))
        backbone.load_state_dict(
            {name: tensor.detach().clone() for name, tensor in state.items()}, assign=True
        )
        device = next(actor.parameters()).device
        recompute_nonpersistent_buffers(backbone, device)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            return cls(backbone, head_init_std=head_init_std)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-position values.

        Padded rows pass ``attention_mask`` (position ids follow from it); a packed row
        (:func:`~brace_lightning.models.packing.packed_values`) passes only ``position_ids``, which
        restart at 0 at every packed sequence, so the backbone builds a block-diagonal causal mask.

        Args:
            input_ids: ``[B, T]`` long, prompts left-padded.
            attention_mask: ``[B, T]`` bool or integer, True at real tokens; None = all real.
            position_ids: ``[B, T]`` long; None = derived from ``attention_mask``.

        Returns:
            ``[B, T]`` float32; ``values[b, t]`` is V of the prefix ending at column t, 0 at padding.
        """
        if attention_mask is None and position_ids is None:
            raise ValueError(
                "ValueModel.forward got neither attention_mask nor position_ids; expected at least "
                "one of them."
            )
        if position_ids is None:
            position_ids = position_ids_from_attention_mask(attention_mask)
        hidden = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state  # [B, T, H]
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
        if attention_mask is None:
            return values.clone()  # not a view of the head's output (FSDP2 warns about views)
        return torch.where(attention_mask.bool(), values, torch.zeros_like(values))


def transformer_of(model: nn.Module) -> nn.Module:
    """The transformer (Hugging Face base model) of a causal LM or of a :class:`ValueModel`."""
    return model.backbone if isinstance(model, ValueModel) else model.base_model
