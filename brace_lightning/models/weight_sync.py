"""Unsharded weights of an FSDP2 model, gathered in bounded buckets, to every rank or to one.

:func:`~brace_lightning.models.parallelize.full_state_dict` gathers the whole state dict on every
rank before anyone uses it: each rank then holds one extra full copy of the model (28–128 GB at
7B–32B in fp32). :func:`gathered_buckets` yields the same tensors a few at a time instead: the
state dict is cut into buckets of at most ``bucket_bytes`` (a tensor larger than that is a bucket of
its own), every rank takes part in the gathers of one bucket (one collective per tensor, as
``full_state_dict``), and only the receiving ranks hold the full tensors of that bucket; the caller
hands each bucket on (to an engine, a weight slot) and drops it before the next one is gathered.
With ``dst=None`` every rank receives (each rank's own engine needs the weights); with ``dst=r``
only global rank ``r`` does (``torch.distributed.gather``), and the other ranks only send their
shards (no copy, except the zero padding of a short last shard). Tied parameters (the embedding and
the LM head) are gathered once and given under both names.

The tensors are the bytes of each rank's dim-0 shard put back in rank order, so they are
bit-identical to ``DTensor.full_tensor()`` (the tests compare them with ``full_state_dict``).

Collectives: every rank of the model's mesh must iterate :func:`gathered_buckets` to the end, in
the same order; a rank that stops early leaves the others waiting in the next gather.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from brace_lightning.models.health import nonfinite_message, nonfinite_names
from brace_lightning.models.parallelize import WRAPPER_PREFIX

#: Default of ``model.weight_sync_bucket_mb``: the most bytes of full tensors held at once (MiB).
DEFAULT_BUCKET_MB = 512

MIB = 2**20


def bucket_bytes_from_mb(value: object, name: str = "weight_sync_bucket_mb") -> int | None:
    """Bytes of a bucket from a size in MiB (None stays None: the whole state dict at once).

    Raises:
        ValueError: unless ``value`` is None or an integer >= 1.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be None (gather the whole state dict at once) or an integer number of "
            f"MiB >= 1; got {value!r}."
        )
    return value * MIB


def module_bucket_bytes(module: object) -> int | None:
    """A trainer module's bucket size in bytes, as it converted ``weight_sync_bucket_mb`` once
    (``weight_sync_bucket_bytes``; the default for a module without it; None = the whole state
    dict at once)."""
    return getattr(module, "weight_sync_bucket_bytes", DEFAULT_BUCKET_MB * MIB)


def _nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()


def plan_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """The state dict's names, in order, cut into buckets whose full tensors take at most
    ``bucket_bytes`` together; a tensor larger than ``bucket_bytes`` is a bucket of its own.

    Raises:
        ValueError: when ``bucket_bytes`` < 1.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"plan_buckets got bucket_bytes={bucket_bytes!r}; expected an int >= 1.")
    buckets: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, tensor in state.items():
        nbytes = _nbytes(tensor)
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _is_dim0_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor on a 1-D mesh with FSDP2's ``Shard(0)`` placement and at least one dimension."""
    return (
        isinstance(tensor, DTensor)
        and tensor.device_mesh.ndim == 1
        and tuple(tensor.placements) == (Shard(0),)
        and tensor.ndim >= 1
    )


def _check_dst(dst: int | None) -> None:
    if dst is None:
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world:
        raise ValueError(
            f"gathered_buckets got dst={dst!r}; expected None (every rank receives) or a global "
            f"rank in [0, {world})."
        )


def _receives(dst: int | None) -> bool:
    if dst is None:
        return True
    return (dist.get_rank() if dist.is_initialized() else 0) == dst


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{state-dict name: first name of the same parameter}`` for tied parameters (e.g.
    ``lm_head.weight`` -> ``model.embed_tokens.weight`` with tied embeddings); the same on every
    rank, as it comes from the module tree."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for raw, param in model.named_parameters(remove_duplicate=False):
        name = raw.replace(WRAPPER_PREFIX, "")
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def gathered_buckets(
    model: nn.Module, *, bucket_bytes: int, dst: int | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """The full (unsharded) ``model.state_dict()`` as buckets of detached CPU tensors.

    Args:
        model: a model sharded with FSDP2 (or not: then the tensors are copied, no collective).
        bucket_bytes: upper bound on the bytes of one bucket's full tensors (one tensor larger
            than that is a bucket alone); see :func:`plan_buckets`.
        dst: None = every rank receives every bucket; a global rank = only that rank receives, the
            others yield nothing but still take part in every gather.

    Yields:
        On receiving ranks, ``{name: full tensor}`` per bucket: the state dict's names (Hugging
        Face names, as :func:`~brace_lightning.models.parallelize.full_state_dict`) in order,
        except that a tied parameter's second name comes right after its first, with the same
        tensor (gathered once). Every rank must exhaust the iterator (module docstring).

    Raises:
        ValueError: for a ``dst`` outside the ranks or ``bucket_bytes`` < 1.
    """
    _check_dst(dst)
    state = model.state_dict()
    aliases = {a: f for a, f in tied_aliases(model).items() if a in state and f in state}
    unique = {name: t for name, t in state.items() if name not in aliases}
    plan = plan_buckets(unique, bucket_bytes)
    receives = _receives(dst)
    for names in plan:
        bucket: dict[str, torch.Tensor] = {}
        for name in names:
            full = _gather_tensor(unique[name], dst, receives)
            if full is not None:
                bucket[name] = full
                bucket.update({a: full for a, f in aliases.items() if f == name})
        if receives:
            yield bucket


@torch.no_grad()
def _gather_tensor(tensor: torch.Tensor, dst: int | None, receives: bool) -> torch.Tensor | None:
    """The full CPU tensor of one state-dict entry on a receiving rank, None on the others.

    A dim-0 sharded DTensor is gathered with one ``all_gather`` (``dst`` None) or ``gather`` into
    a ``[world, rows per rank]`` buffer whose first rows are the full tensor (torch.chunk puts the
    padding last), which is returned as a view: no copy beyond the gather. Another DTensor uses
    its own ``full_tensor()``; a plain (replicated) tensor is copied."""
    if not _is_dim0_sharded(tensor):
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()  # a collective on every rank
        return tensor.detach().to("cpu", copy=True) if receives else None
    assert isinstance(tensor, DTensor)
    group = tensor.device_mesh.get_group()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    shape = tuple(tensor.shape)
    chunk = math.ceil(shape[0] / world) if shape[0] else 0
    local = tensor.to_local().detach()
    rows = max(0, min(chunk, shape[0] - rank * chunk))
    if tuple(local.shape) != (rows, *shape[1:]):
        raise ValueError(
            f"gathered_buckets got a shard of shape {tuple(local.shape)} on rank {rank}; expected "
            f"{(rows, *shape[1:])} (torch.chunk sharding of {shape} on dim 0)."
        )
    send = local.contiguous()
    if rows < chunk:  # the last shards: pad to the common size of the gather
        padded = torch.zeros((chunk, *shape[1:]), dtype=send.dtype, device=send.device)
        padded[:rows] = send
        send = padded
    send_bytes = send.reshape(-1).view(torch.uint8)
    gathered = (
        torch.empty((world, send_bytes.numel()), dtype=torch.uint8, device=send.device)
        if receives
        else None
    )
    if dst is None:
        assert gathered is not None
        # all_gather_single (torch >= 2.13) is the new name of all_gather_into_tensor
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(gathered.view(-1), send_bytes, group=group)
    else:
        parts = None if gathered is None else list(gathered.unbind(0))
        group_dst = dist.get_group_rank(group, dst)
        dist.gather(send_bytes, gather_list=parts, group=group, group_dst=group_dst)
    if gathered is None:
        return None
    full_bytes = math.prod(shape) * tensor.element_size()
    full = gathered.reshape(-1)[:full_bytes].view(tensor.dtype).view(shape)
    return full if full.device.type == "cpu" else full.to("cpu")


def gather_state_dict(
    model: nn.Module, *, bucket_bytes: int, dst: int | None = 0
) -> dict[str, torch.Tensor] | None:
    """The full state dict accumulated from :func:`gathered_buckets` on the receiving rank(s),
    None on the others (a collective: every rank calls it). With ``dst`` a rank, the others never
    hold more than their part of one bucket."""
    weights: dict[str, torch.Tensor] = {}
    received = False
    for bucket in gathered_buckets(model, bucket_bytes=bucket_bytes, dst=dst):
        weights.update(bucket)
        received = True
    return weights if received or _receives(dst) else None


def drain(buckets: Iterable[object]) -> None:
    """Run a bucket stream to its end (its remaining gathers), dropping what it yields."""
    for _ in buckets:
        pass


@torch.no_grad()
def require_finite_shards(model: nn.Module, *, rollout_step: int) -> None:
    """:func:`~brace_lightning.models.health.require_finite_weights` for a sharded model without
    gathering it: each rank checks its own shards, one all-reduce over the model's mesh tells
    every rank whether any shard is non-finite, and then every rank raises the same
    FloatingPointError (a collective: every rank must call it)."""
    state = model.state_dict()
    local = {name: t.to_local() if isinstance(t, DTensor) else t for name, t in state.items()}
    bad = nonfinite_names(local)
    sharded = next((t for t in state.values() if isinstance(t, DTensor)), None)
    if sharded is not None and dist.is_initialized():
        group = sharded.device_mesh.get_group()
        flag = torch.tensor([float(bool(bad))], device=sharded.to_local().device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not bool(flag.item()):
            return
        parts: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, bad, group=group)
        found = {name for part in parts for name in part or []}  # type: ignore[attr-defined]
        bad = [name for name in state if name in found]
    if bad:
        total = sum(1 for t in state.values() if t.is_floating_point() and t.numel())
        raise FloatingPointError(nonfinite_message(bad, total, rollout_step))
