"""FSDP2 for the actor and the critic, applied from outside the models (torchtitan style).

:func:`parallelize` shards every transformer block of a model with
:func:`torch.distributed.fsdp.fully_shard`, then the root (embeddings, final norm, LM or value
head), over the data-parallel dimension of a device mesh. Activation checkpointing, when asked for,
wraps each block before it is sharded (without FSDP2, :func:`checkpoint_activations` uses
transformers' gradient checkpointing of the same blocks). Calling it again on a sharded model changes nothing, so
Lightning's ``configure_model`` may run more than once.

The rollout engines need plain, unsharded weights: :func:`full_state_dict` gathers a sharded model's
weights on every rank (with the Hugging Face key names) and :func:`unsharded_copy` returns a model the
engines can copy (filled bucket by bucket, ``models/weight_sync.py``). Both are the identity on a
model that is not sharded, so the data modules call them unconditionally. The trainer's publish path
streams buckets instead of calling :func:`full_state_dict` (``docs/fsdp.md``).

Simplified: only data parallelism (FSDP2's ZeRO-3 sharding, ``reshard_after_forward=True``); a mesh
with a tensor-parallel dimension larger than 1 is refused rather than silently used as replicas.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from brace_lightning.models.critic import ValueModel, transformer_of
from brace_lightning.models.policy import load_causal_lm
from brace_lightning.models.weight_sync import DEFAULT_BUCKET_MB, MIB, gathered_buckets

#: What ``checkpoint_wrapper`` (activation checkpointing under FSDP2, see :func:`parallelize`) adds
#: to the parameter names of a wrapped block; removed wherever names must be Hugging Face's.
WRAPPER_PREFIX = "_checkpoint_wrapped_module."

#: Where Hugging Face decoder-only models keep their blocks: ``model.layers`` (Llama, Qwen2, Mistral,
#: Gemma, ...) on the causal LM's base model, ``h`` (GPT-2, Falcon) or ``layers``.
BLOCK_LISTS = ("layers", "h", "blocks", "decoder.layers")

#: Values of ``model.fsdp_mixed_precision``: ``"auto"`` = bf16 parameters with fp32 gradient
#: reduction on GPU, full fp32 on CPU; ``"bf16"`` = bf16 parameters, fp32 reduction everywhere
#: (gloo can all-gather bf16 on CPU); ``"fp32"`` = no mixed precision.
MIXED_PRECISION = ("auto", "bf16", "fp32")


def mixed_precision_dtypes(
    setting: str, device_type: str
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` for :func:`parallelize` from a ``fsdp_mixed_precision``
    setting (see :data:`MIXED_PRECISION`) and the device type of the ranks (``"cpu"``, ``"cuda"``).

    Raises:
        ValueError: for a setting outside :data:`MIXED_PRECISION`.
    """
    if setting not in MIXED_PRECISION:
        raise ValueError(
            f"fsdp_mixed_precision must be one of {', '.join(MIXED_PRECISION)}; got {setting!r}."
        )
    if setting == "fp32" or (setting == "auto" and device_type == "cpu"):
        return None, None
    return torch.bfloat16, torch.float32


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks of a causal LM, a base model or a :class:`ValueModel`.

    Raises:
        ValueError: when none of :data:`BLOCK_LISTS` is a ``ModuleList`` of the base model.
    """
    base = model.backbone if isinstance(model, ValueModel) else model
    base = getattr(base, "base_model", base)
    for path in BLOCK_LISTS:
        found: object = base
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, nn.ModuleList) and len(found):
            return found
    raise ValueError(
        f"parallelize found no transformer blocks in {type(model).__name__} (looked for "
        f"{', '.join(BLOCK_LISTS)} on its base model {type(base).__name__}); expected a "
        "Hugging Face decoder-only model."
    )


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D data-parallel mesh of Lightning's ``ModelParallelStrategy`` mesh (or ``mesh`` itself).

    Raises:
        ValueError: when the mesh has a tensor-parallel dimension of size > 1.
    """
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        return mesh
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"parallelize got a device mesh with tensor_parallel size "
            f"{mesh['tensor_parallel'].size()}; expected 1 (set ModelParallelStrategy("
            "tensor_parallel_size=1); only FSDP data parallelism is implemented)."
        )
    if "data_parallel" not in names:
        raise ValueError(
            f"parallelize got a {mesh.ndim}-D device mesh with dims {names}; expected a "
            "'data_parallel' dimension."
        )
    return mesh["data_parallel"]


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    activation_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2: each transformer block, then the root.

    Args:
        model: a Hugging Face causal LM (the actor) or a :class:`ValueModel` (the critic).
        mesh: the device mesh (``LightningModule.device_mesh``); its ``data_parallel`` dimension is
            used when it is 2-D.
        activation_checkpointing: recompute each block's activations in the backward pass
            (``checkpoint_wrapper``, applied before sharding); saves memory, costs one more forward.
        param_dtype: FSDP2 mixed precision: the dtype parameters are all-gathered and computed in
            (e.g. ``torch.bfloat16``); None keeps the parameters' dtype.
        reduce_dtype: dtype of the gradient reduce-scatter (e.g. ``torch.float32``); None = the
            ``param_dtype``. A :class:`ValueModel`'s value head is sharded on its own with fp32
            parameters whatever ``param_dtype`` is (values are regressed in fp32).
        cpu_offload: FSDP2 ``CPUOffloadPolicy``: parameter shards, gradients and the optimizer
            states live in host memory (pinned), copied to the GPU for each forward/backward; the
            optimizer step runs on the CPU. Saves about 16 bytes per parameter / world size of GPU
            memory (fp32 Adam) at the cost of host-device copies every step and a CPU optimizer.

    Returns:
        ``model`` itself; a model that is already an ``FSDPModule`` is returned unchanged.
    """
    if isinstance(model, FSDPModule):
        return model
    dp_mesh = data_parallel_mesh(mesh)
    if cpu_offload and dp_mesh.device_type == "cpu":
        raise ValueError(
            "parallelize got cpu_offload=True on a 'cpu' device mesh; expected a GPU mesh (on "
            "CPU the shards already live in host memory: set fsdp_cpu_offload=False)."
        )
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    blocks = transformer_blocks(model)
    for index, block in enumerate(blocks):
        if activation_checkpointing and not isinstance(block, CheckpointWrapper):
            # preserve_rng_state=False: the blocks have no dropout in training (HF default 0.0).
            block = checkpoint_wrapper(block, preserve_rng_state=False)
            blocks[index] = block
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, offload_policy=offload)
    if isinstance(model, ValueModel) and param_dtype not in (None, torch.float32):
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        fully_shard(model.value_head, mesh=dp_mesh, mp_policy=fp32, offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, offload_policy=offload)
    return model


def checkpoint_activations(model: nn.Module) -> nn.Module:
    """Recompute each transformer block's activations in the backward pass of an unsharded model
    (single device, DDP): transformers' own gradient checkpointing of its decoder layers,
    non-reentrant, so parameter names, state dicts and the engines' weights are unchanged. Under
    FSDP2, :func:`parallelize` wraps the blocks instead.

    Args:
        model: a Hugging Face causal LM (the actor) or a :class:`ValueModel` (the critic).

    Returns:
        ``model`` itself (calling it again changes nothing).

    Raises:
        ValueError: when the model's transformers class has no gradient checkpointing.
    """
    base = transformer_of(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"activation_checkpointing=True got a {type(base).__name__}, which has no gradient "
            "checkpointing in transformers; expected a decoder that supports it (or FSDP2)."
        )
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or one of its submodules) was sharded with FSDP2."""
    return any(isinstance(module, FSDPModule) for module in model.modules())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded tensor gathered: full, detached CPU tensors.

    Keys are the model's own (Hugging Face) names: FSDP2 adds no prefix and the checkpoint wrapper
    removes its ``_checkpoint_wrapped_module.``. On a sharded model this is a collective: every rank
    must call it, in the same order; each rank gets the full weights (the engines of all ranks need
    them), gathered one tensor at a time.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().to("cpu", copy=True)
    return out


def unsharded_copy(
    model: nn.Module, *, bucket_bytes: int | None = DEFAULT_BUCKET_MB * MIB
) -> nn.Module:
    """A model the rollout engines can deep-copy: ``model`` itself when it is not sharded, else a
    fresh model built from its config holding the full weights (a collective), on the device of
    this rank's shards (so a GPU rank's engine generates on its GPU).

    The weights arrive in buckets of at most ``bucket_bytes`` (``models/weight_sync.py``), each
    copied into the fresh model and dropped; None gathers :func:`full_state_dict` whole first.

    Raises:
        ValueError: when a sharded model is not a Hugging Face ``PreTrainedModel``.
    """
    if not is_sharded(model):
        return model
    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"unsharded_copy got a sharded {type(model).__name__}; expected a transformers "
            "PreTrainedModel (it is rebuilt from its config)."
        )
    device = next(model.parameters()).device  # a DTensor reports its local device
    config = copy.deepcopy(model.config)
    dtype = next(iter(model.state_dict().values())).dtype
    plain = load_causal_lm(config, dtype=dtype, seed=0)
    if bucket_bytes is None:
        plain.load_state_dict(full_state_dict(model), strict=True)
        return plain.to(device).eval()
    target = plain.state_dict()
    filled: set[str] = set()
    with torch.no_grad():
        for bucket in gathered_buckets(model, bucket_bytes=bucket_bytes):
            for name, tensor in bucket.items():
                if name in target:
                    target[name].copy_(tensor)
                filled.add(name)
    if filled != set(target):
        raise ValueError(
            f"unsharded_copy got {len(filled)} tensors for the fresh model's {len(target)} "
            f"({len(set(target) - filled)} missing, {len(filled - set(target))} unexpected); "
            "expected the sharded model's state dict to have the same keys as its config's model."
        )
    return plain.to(device).eval()
