"""The FSDP memory benchmark's per-rank peak (``benchmarks/fsdp_memory.py``) counts what the rank
itself touched: a rank spawned by a parent that holds a large tensor does not report it (the
``ru_maxrss`` it used before did: a spawned process starts with its parent's peak)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from benchmarks.fsdp_memory import peak_above, start_peak

MIB = 2**20


def _touch_and_measure(rank: int, out: str) -> None:
    base = start_peak()
    touched = torch.ones(64 * MIB // 4)  # every page written
    del touched
    torch.save(peak_above(base), f"{out}/peak{rank}.pt")


@pytest.mark.slow
def test_a_spawned_rank_reports_its_own_peak_not_its_parents(tmp_path: Path) -> None:
    held = torch.ones(512 * MIB // 4)  # the parent's model, alive while the rank runs
    mp.spawn(_touch_and_measure, args=(str(tmp_path),), nprocs=1)
    del held
    peak = torch.load(tmp_path / "peak0.pt")
    assert 64 * MIB <= peak < 96 * MIB, f"peak {peak / MIB:.0f} MiB"
