"""The one way weights leave the trainer: :class:`ActorHandoff`.

The rollout engines need the actor's full, unsharded weights with their Hugging Face names, once to
build an engine and again after every actor update. How to get them depends on how the actor is
held, and that choice is made here, once:

- not sharded (one device, DDP): the actor's own ``state_dict()`` (no copy); for a LoRA actor
  (``models/lora.py``) the merged weights under the base model's names (a new tensor per adapted
  layer), so no engine sees a peft name;
- sharded with FSDP2 and ``bucket_bytes`` set: :func:`~brace_lightning.models.weight_sync.gathered_buckets`,
  the state dict gathered a bucket of at most ``bucket_bytes`` at a time, so a rank never holds a
  second full copy (``docs/fsdp.md``);
- sharded with ``bucket_bytes=None``: :func:`~brace_lightning.models.parallelize.full_state_dict`,
  gathered whole on every rank first (one bucket).

The module builds one handoff from its actor (``BraceModule.setup``), hands it to the data module
(``connect``) and publishes ``handoff.buckets()`` after every actor update. The data modules never
see the actor or the module.

Contract of :meth:`ActorHandoff.buckets`: the tensors of a bucket are valid only during the publish
call that receives them (they may be the live parameters, or a gather buffer the next bucket
reuses); a data module copies what it keeps. On a sharded actor the stream is a collective: every
rank must run it to its end (the module drains what a data module left).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from brace_lightning.models.health import require_finite_weights
from brace_lightning.models.lora import has_adapters, merged_copy, merged_state_dict
from brace_lightning.models.parallelize import full_state_dict, is_sharded
from brace_lightning.models.policy import load_causal_lm
from brace_lightning.models.weight_sync import gathered_buckets, require_finite_shards


class ActorHandoff:
    """The actor's weights as the rollout engines need them (module docstring).

    Args:
        actor: the trainer's actor, sharded with FSDP2 or not (it may be sharded after the handoff
            is built: each call looks at how it is held then).
        bucket_bytes: under FSDP2, the most bytes of full tensors gathered at once (converted
            from ``weight_sync_bucket_mb`` by the module); None gathers the whole state dict.
    """

    def __init__(self, actor: nn.Module, *, bucket_bytes: int | None) -> None:
        self._actor = actor
        self.bucket_bytes = bucket_bytes

    @property
    def config(self) -> PretrainedConfig | None:
        """The actor's Hugging Face config (what a producer process rebuilds it from), or None."""
        config = getattr(self._actor, "config", None)
        return config if isinstance(config, PretrainedConfig) else None

    @property
    def actor_name(self) -> str:
        """The actor's class name (for error messages)."""
        return type(self._actor).__name__

    def template(self) -> Mapping[str, torch.Tensor]:
        """Names, shapes and dtypes of the full state dict, gathering nothing (a sharded tensor
        reports its full shape): what weight slots are allocated from. Do not read the values."""
        return merged_state_dict(self._actor)

    def buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """The full state dict (Hugging Face names) as a stream of disjoint buckets.

        Valid only during the publish call (module docstring); on a sharded actor every rank
        must run the stream to its end.
        """
        if not is_sharded(self._actor):
            yield merged_state_dict(self._actor)
        elif self.bucket_bytes is None:
            yield full_state_dict(self._actor)
        else:
            yield from gathered_buckets(self._actor, bucket_bytes=self.bucket_bytes)

    def require_finite(self, *, rollout_step: int) -> None:
        """Raise FloatingPointError naming the first non-finite tensor of the actor (a sharded
        actor is checked shard by shard, one all-reduce: a collective on every rank)."""
        if is_sharded(self._actor):
            require_finite_shards(self._actor, rollout_step=rollout_step)
        else:
            require_finite_weights(self._actor.state_dict(), rollout_step=rollout_step)

    def engine_model(self) -> nn.Module:
        """A model the rollout engines can deep-copy: the actor itself when it is not sharded (a
        plain copy with merged weights for a LoRA actor), else a fresh model built from its config
        and filled from :meth:`buckets` (a collective), on the device of this rank's shards (so a
        GPU rank's engine generates on its GPU).

        Raises:
            ValueError: when a sharded actor is not a Hugging Face ``PreTrainedModel``, or its
                state dict does not have the keys of its config's model.
        """
        model = self._actor
        if not is_sharded(model):
            return merged_copy(model) if has_adapters(model) else model
        if not isinstance(model, PreTrainedModel):
            raise ValueError(
                f"engine_model got a sharded {type(model).__name__}; expected a transformers "
                "PreTrainedModel (it is rebuilt from its config)."
            )
        device = next(model.parameters()).device  # a DTensor reports its local device
        dtype = next(iter(model.state_dict().values())).dtype
        plain = load_causal_lm(copy.deepcopy(model.config), dtype=dtype, seed=0)
        target = plain.state_dict()
        filled: set[str] = set()
        with torch.no_grad():
            for bucket in self.buckets():
                for name, tensor in bucket.items():
                    if name in target:
                        target[name].copy_(tensor)
                    filled.add(name)
        if filled != set(target):
            raise ValueError(
                f"engine_model got {len(filled)} tensors for the fresh model's {len(target)} "
                f"({len(set(target) - filled)} missing, {len(filled - set(target))} unexpected); "
                "expected the sharded model's state dict to have the same keys as its config's model."
            )
        return plain.to(device).eval()
