"""Shared helpers for the benchmark scripts: medians of repeated runs, peak extra memory and the
argparse types of their size and count options."""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def positive_int(text: str) -> int:
    """argparse type of a count option: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {text!r}")
    return int(text)


def model_size(text: str) -> tuple[int, int]:
    """argparse type of a tiny Qwen2 size ``HIDDENxLAYERS`` such as ``64x1``."""
    hidden, _, layers = text.partition("x")
    if not (hidden.isdigit() and layers.isdigit() and int(hidden) > 0 and int(layers) > 0):
        raise argparse.ArgumentTypeError(f"expected HIDDENxLAYERS such as 64x1; got {text!r}")
    return int(hidden), int(layers)


def median_seconds(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs (CUDA-synchronised)."""
    return interleaved_median_seconds({"fn": fn}, repeats=repeats, warmup=warmup)["fn"]


def interleaved_median_seconds(
    fns: dict[str, Callable[[], object]], *, repeats: int = 3, warmup: int = 1
) -> dict[str, float]:
    """Median wall time of every ``fn()`` of ``fns``, the runs taken in turns (one of each per
    round) after ``warmup`` rounds, so that load from other processes on a shared machine falls on
    every case alike rather than on whichever ran while it lasted (CUDA-synchronised)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def in_mmap_subprocess(module: str, args: list[str]) -> str:
    """Run ``python -m module *args`` with glibc's mmap threshold fixed at 64 KiB; its stdout.

    glibc raises its mmap threshold dynamically after the first large free, after which freed
    tensors stay in the heap and the resident high-water mark no longer tracks live tensors. With a
    fixed threshold every tensor above 64 KiB has its own mapping, returned to the OS on free, so
    :func:`peak_extra_mib` is exact. It also slows every allocation, so timings are taken elsewhere.
    """
    return run_mmap_subprocess(module, args, check=True).stdout


def run_mmap_subprocess(
    module: str, args: list[str], *, max_bytes: int | None = None, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """:func:`in_mmap_subprocess`'s child, its output captured; ``max_bytes`` caps its address
    space (``RLIMIT_AS``), so that a run too large for the machine fails in the child with an
    allocation error instead of pushing the machine into swap or the OOM killer."""

    def limit() -> None:
        if max_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        check=check,
        preexec_fn=limit,
    )


def proc_kib(field: str, path: str = "/proc/self/status") -> int:
    """A ``field: N kB`` line of a Linux ``/proc`` file, in KiB (``VmRSS``, ``VmHWM`` of this
    process; ``MemAvailable`` of ``/proc/meminfo``)."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{path} has no {field} line; expected Linux.")


def peak_extra_mib(fn: Callable[[], object], device: str = "cpu") -> float | None:
    """Peak memory ``fn()`` allocates above what was live before it, in MiB.

    CUDA: the allocator's peak counter. CPU (Linux): the process's resident high-water mark, reset
    through ``/proc/self/clear_refs`` before the call (large tensors are mmap-ed and returned on
    free when run under :func:`in_mmap_subprocess`). None where neither is available.
    """
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = proc_kib("VmRSS")
        fn()
        return max(0, proc_kib("VmHWM") - before) / 1024
    except OSError:
        return None
