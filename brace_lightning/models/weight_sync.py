"""Unsharded weights of an FSDP2 model, gathered in bounded buckets, to every rank or to one.

:func:`~brace_lightning.models.parallelize.full_state_dict` gathers the whole state dict on every
rank before anyone uses it: each rank then holds one extra full copy of the model (28–128 GB at
7B–32B in fp32). :func:`gathered_buckets` yields the same tensors a few at a time instead: the
state dict is cut into buckets of at most ``bucket_bytes`` (a tensor larger than that is a bucket of
its own), every rank takes part in one gather per bucket, and only the receiving ranks build the
full tensors of that bucket; the caller hands each bucket on (to an engine, a weight slot) and drops
it before the next one is gathered. With ``dst=None`` every rank receives (each rank's own engine
needs the weights); with ``dst=r`` only global rank ``r`` does (``torch.distributed.gather``), and
the other ranks only send their shards of the bucket, about ``bucket_bytes / world_size`` each.

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

#: Default of ``model.weight_sync_bucket_mb``: tensors gathered together per collective (MiB).
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
    """The bucket size of a trainer module's ``weight_sync_bucket_mb`` in bytes (the default for
    a module without the attribute; None = gather the whole state dict at once)."""
    return bucket_bytes_from_mb(getattr(module, "weight_sync_bucket_mb", DEFAULT_BUCKET_MB))


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
        On receiving ranks, ``{name: full tensor}`` per bucket, keys in ``state_dict`` order
        (Hugging Face names, as :func:`~brace_lightning.models.parallelize.full_state_dict`).
        Every rank must exhaust the iterator (see the module docstring).

    Raises:
        ValueError: for a ``dst`` outside the ranks or ``bucket_bytes`` < 1.
    """
    _check_dst(dst)
    state = model.state_dict()
    plan = plan_buckets(state, bucket_bytes)
    receives = _receives(dst)
    for names in plan:
        bucket = _gather_bucket({name: state[name] for name in names}, dst, receives)
        if receives:
            yield bucket


@torch.no_grad()
def _gather_bucket(
    tensors: dict[str, torch.Tensor], dst: int | None, receives: bool
) -> dict[str, torch.Tensor]:
    """One bucket: the dim-0 shards of all its sharded tensors in one flat byte buffer per rank,
    one ``all_gather`` (``dst`` None) or ``gather`` to ``dst``; other tensors handled alone."""
    out: dict[str, torch.Tensor] = {}
    flat = [name for name, t in tensors.items() if _is_dim0_sharded(t)]
    if flat:
        first = tensors[flat[0]]
        assert isinstance(first, DTensor)
        mesh = first.device_mesh
        flat = [n for n in flat if tensors[n].device_mesh == mesh]  # type: ignore[attr-defined]
        _gather_flat({n: tensors[n] for n in flat}, mesh.get_group(), dst, receives, out)
    for name, tensor in tensors.items():
        if name in out or (name in flat and not receives):
            continue
        if isinstance(tensor, DTensor):  # another placement: the DTensor's own all-gather
            tensor = tensor.full_tensor()
        if receives:
            out[name] = tensor.detach().to("cpu", copy=True)
    return {name: out[name] for name in tensors if name in out}


def _gather_flat(
    tensors: dict[str, torch.Tensor],
    group: dist.ProcessGroup,
    dst: int | None,
    receives: bool,
    out: dict[str, torch.Tensor],
) -> None:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    layout: list[tuple[str, int, int, int]] = []  # name, offset, padded bytes per rank, bytes
    offset = 0
    for name, tensor in tensors.items():
        rows = tensor.shape[0]
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
        padded = math.ceil(rows / world) * row_bytes  # torch.chunk: full chunks, then the rest
        layout.append((name, offset, padded, rows * row_bytes))
        offset += padded
    first = next(iter(tensors.values()))
    assert isinstance(first, DTensor)
    device = first.to_local().device
    send = torch.zeros(offset, dtype=torch.uint8, device=device)
    for (name, start, padded, total), tensor in zip(layout, tensors.values(), strict=True):
        assert isinstance(tensor, DTensor)
        local = tensor.to_local().detach().contiguous().reshape(-1).view(torch.uint8)
        expected = max(0, min(padded, total - rank * padded))
        if local.numel() != expected:
            raise ValueError(
                f"gathered_buckets: the shard of {name!r} on rank {rank} has {local.numel()} "
                f"bytes; expected {expected} (torch.chunk sharding on dim 0)."
            )
        send[start : start + local.numel()].copy_(local)
    gathered = torch.empty((world, offset), dtype=torch.uint8, device=device) if receives else None
    if dst is None:
        assert gathered is not None
        dist.all_gather(list(gathered.unbind(0)), send, group=group)
    else:
        group_dst = dist.get_group_rank(group, dst)
        parts = list(gathered.unbind(0)) if gathered is not None else None
        dist.gather(send, gather_list=parts, group=group, group_dst=group_dst)
    del send
    if gathered is None:
        return
    for (name, start, padded, total), tensor in zip(layout, tensors.values(), strict=True):
        full = torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
        full_bytes = full.reshape(-1).view(torch.uint8)
        for source in range(world):
            lo = source * padded
            hi = min(lo + padded, total)
            if hi > lo:
                full_bytes[lo:hi].copy_(gathered[source, start : start + hi - lo])
        out[name] = full


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


def collect_buckets(buckets: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One dict from a stream of buckets (for consumers that need the whole state dict)."""
    weights: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        weights.update(bucket)
    return weights


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
