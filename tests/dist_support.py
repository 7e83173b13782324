"""Gloo process groups for the FSDP tests: a one-process group for the in-process mesh fixtures,
and spawned processes that each join a multi-rank group as one rank."""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    """One spawned rank: join the group, run ``fn``, leave the group, and exit at once.

    The ranks meet at a barrier before any of them destroys the group, so none tears gloo down
    while another still has a collective in flight. After an error the group is destroyed at once,
    so the other rank's next collective fails instead of waiting at the barrier.

    A rank that finished cleanly then leaves with ``os._exit(0)``, skipping interpreter
    finalization. Without that, a rank sometimes died with "terminate called without an active
    exception" (SIGABRT) after the group was destroyed: once in CI, and in 1 of 50 runs of a test
    here (two runs at a time on 2 cores). The core dump of that run shows gloo's worker thread
    (``ProcessGroupGloo::runLoop``) releasing a finished all-gather whose output tensors still
    refer to Python objects: it takes the GIL while the main thread is in ``Py_FinalizeEx``, Python
    ends such a thread, and the unwind through C++ calls ``std::terminate``. The results are saved
    by then, and finalization is not what these tests test. ``faulthandler`` stays on, so a crash
    before that point shows its Python frames.
    """
    faulthandler.enable(all_threads=True)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
