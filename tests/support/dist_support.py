"""Gloo process groups for the FSDP tests: a one-process group for the in-process mesh fixtures,
and spawned processes that each join a multi-rank group as one rank."""

from __future__ import annotations

import faulthandler
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.fsdp_memory import leave_group_and_exit
from brace_lightning.rollout.vllm_server import free_port


@contextmanager
def one_process_group() -> Iterator[None]:
    """The default process group with this process as its only rank, for the ``with`` block.

    An in-process vLLM engine from an earlier test module leaves its own one-process gloo group
    behind (it is vLLM's to destroy); that group is the same one-rank world, so it is used as is and
    left in place. Otherwise a group is created here and destroyed on exit.
    """
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    if dist.get_world_size() != 1:
        raise RuntimeError(
            f"the default process group has {dist.get_world_size()} ranks; expected one."
        )
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def spawn_gloo_ranks(fn: Callable[..., None], *args: object, world_size: int = 2) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` spawned processes, the ranks of one gloo group.

    ``fn`` must be a module-level function (it is pickled). An exception in any rank fails the
    caller with that rank's traceback (``torch.multiprocessing.spawn``).
    """
    mp.spawn(_gloo_rank, args=(fn, free_port(), world_size, args), nprocs=world_size)


def _gloo_rank(
    rank: int, fn: Callable[..., None], port: int, world_size: int, args: tuple[object, ...]
) -> None:
    """One spawned rank: join the group, run ``fn``, then leave the group and the process
    (``leave_group_and_exit``: a barrier, ``destroy_process_group``, ``os._exit(0)``; its docstring
    says why finalization is skipped). After an error the group is destroyed at once and the error
    propagates, so the other rank's next collective fails instead of waiting at the barrier.
    ``faulthandler`` is on, so a rank that dies on a signal shows its Python frames.
    """
    faulthandler.enable(all_threads=True)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group_and_exit()
