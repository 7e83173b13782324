"""Sharded models built on the meta device and filled rank by rank from Hugging Face safetensors.

Building the actor and the critic whole on every rank before sharding costs each rank two full
fp32 copies of the backbone in host memory. Here a model is created on ``torch.device("meta")``
(no storage), sharded with :func:`~brace_lightning.models.parallelize.parallelize`, materialised
with ``to_empty`` (each rank allocates only its shards), and every shard is then read from the
checkpoint's ``*.safetensors`` files with plain file reads at the right offsets (each rank reads
only the rows it keeps, straight into its shard; no memory map). The critic's backbone is read from the same files (its ``backbone.`` keys are the
causal LM's ``model.`` keys); its value head is initialised as in :class:`ValueModel`.
Non-persistent buffers (rotary frequencies) are recomputed from the owning module's config.

Simplified: only FSDP2's dim-0 sharding (``Shard(0)``) and plain tensors are handled; tied input
and output embeddings are filled from the embedding's key when the files omit ``lm_head.weight``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from brace_lightning.models.critic import ValueModel, init_value_head
from brace_lightning.models.parallelize import WRAPPER_PREFIX, parallelize
from brace_lightning.models.policy import recompute_nonpersistent_buffers


def safetensors_index(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the ``.safetensors`` file holding it, for a Hugging Face model folder.

    Raises:
        ValueError: when ``folder`` has neither ``model.safetensors`` nor
            ``model.safetensors.index.json``.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(
            f"model folder {str(folder)!r} has no model.safetensors or "
            "model.safetensors.index.json; expected a folder written by save_pretrained."
        )
    return dict.fromkeys(_read_header(single)[1], single)


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, slice | None]:
    """The tensor this rank writes into and the dim-0 rows of the full tensor it holds."""
    if not isinstance(tensor, DTensor):
        return tensor, None
    if any(not p.is_shard(0) for p in tensor.placements if not p.is_replicate()):
        raise ValueError(
            f"meta_init got a DTensor with placements {tensor.placements}; expected FSDP2's "
            "Shard(0)."
        )
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise ValueError(
            f"meta_init: local shard shape {tuple(local.shape)} differs from the computed "
            f"{tuple(shape)}; expected torch.chunk sharding on dim 0."
        )
    return local, slice(offset[0], offset[0] + shape[0])


@torch.no_grad()
def fill_from_safetensors(
    model: nn.Module,
    folder: str | Path,
    *,
    key_map: dict[str, str],
    skip: tuple[str, ...] = (),
) -> int:
    """Copy each of ``model``'s parameters and persistent buffers (sharded or not) from the
    checkpoint in ``folder``, reading only this rank's rows of every tensor.

    Args:
        model: a materialised model (after ``to_empty``), possibly sharded with FSDP2.
        folder: a Hugging Face model folder with ``.safetensors`` files.
        key_map: prefix rewrites from the model's state-dict names to the files' names (first
            match wins), e.g. ``{"backbone.": "model."}`` for a critic.
        skip: name prefixes that are not read (initialised by the caller).

    Returns:
        The number of bytes read on this rank.

    Raises:
        ValueError: when a tensor is missing from the files or has another shape.
    """
    index = safetensors_index(folder)
    tensors = dict(model.named_parameters()) | {
        name: buffer
        for name, buffer in model.named_buffers()
        if name.rsplit(".", 1)[-1]
        not in model.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set
    }
    headers: dict[Path, tuple[int, dict[str, dict]]] = {}
    read = 0
    for raw_name, tensor in tensors.items():
        name = raw_name.replace(WRAPPER_PREFIX, "")
        if name.startswith(skip):
            continue
        key = name
        for old, new in key_map.items():
            if name.startswith(old):
                key = new + name[len(old) :]
                break
        if key not in index and key == "lm_head.weight":
            key = "model.embed_tokens.weight"  # tied embeddings: the files keep one copy
        if key not in index:
            raise ValueError(
                f"fill_from_safetensors: {name!r} (file key {key!r}) is not in the "
                f"safetensors files of {str(folder)!r}; expected a checkpoint of this "
                "architecture."
            )
        path = index[key]
        if path not in headers:
            headers[path] = _read_header(path)
        data_start, entries = headers[path]
        entry = entries[key]
        if tuple(entry["shape"]) != tuple(tensor.shape):
            raise ValueError(
                f"fill_from_safetensors: {key!r} has shape {tuple(entry['shape'])} in the "
                f"files and {tuple(tensor.shape)} in the model; expected equal shapes."
            )
        local, rows = _local_rows(tensor)
        read += _read_rows(path, data_start, entry, rows, local)
    return read


#: safetensors dtype names -> torch dtypes (the ones model checkpoints use).
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_header(path: Path) -> tuple[int, dict[str, dict]]:
    """``(offset of the data section, {name: {"dtype", "shape", "data_offsets"}})`` of a
    safetensors file (8-byte little-endian header length, then the JSON header)."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def _read_rows(
    path: Path, data_start: int, entry: dict, rows: slice | None, out: torch.Tensor
) -> int:
    """Read rows ``rows`` (all when None) of one tensor of a safetensors file into ``out`` with
    plain file reads (no memory map, so the rest of the file never enters this process's memory);
    returns the bytes read."""
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(
            f"fill_from_safetensors: unsupported safetensors dtype {entry['dtype']!r} in "
            f"{str(path)!r}; expected one of {', '.join(SAFETENSORS_DTYPES)}."
        )
    shape = list(entry["shape"])
    row_bytes = dtype.itemsize * (math.prod(shape[1:]) if shape else 1)
    first = 0 if rows is None or not shape else rows.start
    if rows is not None and shape:
        shape[0] = rows.stop - rows.start
    direct = out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
    buffer = out if direct else torch.empty(shape, dtype=dtype)
    flat = buffer.reshape(-1).view(torch.uint8)
    with open(path, "rb") as handle:
        handle.seek(data_start + entry["data_offsets"][0] + first * row_bytes)
        if flat.numel() and handle.readinto(memoryview(flat.numpy())) != flat.numel():
            raise ValueError(f"fill_from_safetensors: {str(path)!r} is truncated.")
    if not direct:
        out.copy_(buffer.view(out.shape))
    return flat.numel()


@torch.no_grad()
def _init_value_head(critic: ValueModel, *, seed: int, head_init_std: float) -> None:
    """The value head's initialisation (:func:`~brace_lightning.models.critic.init_value_head`)
    drawn whole on the CPU from ``seed``, so every rank holds its rows of the same tensor."""
    weight = critic.value_head.weight
    full = torch.empty(tuple(weight.shape))
    local_bias = _local_rows(critic.value_head.bias)[0]
    init_value_head(
        full, local_bias, std=head_init_std, generator=torch.Generator().manual_seed(seed)
    )
    local, rows = _local_rows(weight)
    local.copy_(full if rows is None else full[rows])


def _materialise(model: nn.Module, device: torch.device | str) -> nn.Module:
    device = torch.device(device)
    model.to_empty(device=device)
    recompute_nonpersistent_buffers(model, device)
    return model


def load_sharded_actor(
    folder: str | Path,
    mesh: DeviceMesh,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **parallelize_kwargs: object,
) -> nn.Module:
    """The causal LM of ``folder`` built on the meta device, sharded over ``mesh`` and filled
    from its safetensors files rank by rank (see the module docstring). Every rank must call it.

    ``parallelize_kwargs`` go to :func:`parallelize` (activation checkpointing, mixed precision).
    """
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        actor = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parallelize(actor, mesh, **parallelize_kwargs)  # type: ignore[arg-type]
    _materialise(actor, device)
    fill_from_safetensors(actor, folder, key_map={})
    return actor.train()


def load_sharded_critic(
    folder: str | Path,
    mesh: DeviceMesh,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    head_init_std: float = 1e-3,
    **parallelize_kwargs: object,
) -> ValueModel:
    """A :class:`ValueModel` whose backbone is read from the causal-LM files of ``folder`` (no
    copy of an actor), built on the meta device and sharded like :func:`load_sharded_actor`; the
    value head is drawn from ``seed`` (the same on every rank)."""
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        critic = ValueModel(AutoModel.from_config(config, dtype=dtype), head_init_std=0.0)
    parallelize(critic, mesh, **parallelize_kwargs)  # type: ignore[arg-type]
    _materialise(critic, device)
    fill_from_safetensors(critic, folder, key_map={"backbone.": "model."}, skip=("value_head.",))
    _init_value_head(critic, seed=seed, head_init_std=head_init_std)
    return critic.train()


@torch.no_grad()
def fill_from_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy this rank's rows of each full tensor of ``state`` into ``model`` (materialised,
    sharded or not); for random models built whole from a seed, so that meta construction gives
    exactly the values of the usual one.

    Raises:
        ValueError: when a parameter or persistent buffer of ``model`` is missing from ``state``.
    """
    for raw_name, tensor in model.state_dict(keep_vars=True).items():
        name = raw_name.replace(WRAPPER_PREFIX, "")
        if name not in state:
            raise ValueError(
                f"fill_from_state_dict found no tensor {name!r} for {type(model).__name__}; "
                "expected the state dict of the same architecture."
            )
        local, rows = _local_rows(tensor)
        local.copy_(state[name] if rows is None else state[name][rows])


def empty_models(config: PretrainedConfig) -> tuple[nn.Module, ValueModel]:
    """An actor (causal LM) and a critic of ``config`` on the meta device (no storage)."""
    with torch.device("meta"):
        empty_actor = AutoModelForCausalLM.from_config(config)
        empty_critic = ValueModel(AutoModel.from_config(config), head_init_std=0.0)
    return empty_actor, empty_critic


def materialise_and_fill(
    actor: nn.Module,
    critic: ValueModel,
    device: torch.device | str,
    *,
    folder: str | None,
    states: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None,
    seed: int,
) -> None:
    """Allocate this rank's shards of a meta-built ``actor`` and ``critic`` on ``device`` and fill
    them: from the safetensors files of ``folder`` (the critic's backbone from the same files,
    its value head from ``seed``), or from the full ``states`` of a random model."""
    for model in (actor, critic):
        _materialise(model, device)
    if folder is not None:
        fill_from_safetensors(actor, folder, key_map={})
        fill_from_safetensors(
            critic, folder, key_map={"backbone.": "model."}, skip=("value_head.",)
        )
        _init_value_head(critic, seed=seed, head_init_std=1e-3)
    elif states is not None:
        fill_from_state_dict(actor, states[0])
        fill_from_state_dict(critic, states[1])
