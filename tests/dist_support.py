"""A one-process gloo group for the in-process FSDP tests, shared by their mesh fixtures."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


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
