"""Shared benchmark helpers (``benchmarks/_common.py``) that the unit tests of each harness do not
cover on their own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_pool_worker_exits_when_the_harness_that_started_it_is_killed(tmp_path):
    parent = tmp_path / "harness.py"
    parent.write_text(
        textwrap.dedent(
            f"""
            import multiprocessing, os, sys, time
            from concurrent.futures import ProcessPoolExecutor
            sys.path.insert(0, {str(ROOT)!r})
            from benchmarks._common import exit_with_parent

            if __name__ == "__main__":
                context = multiprocessing.get_context("spawn")
                pool = ProcessPoolExecutor(
                    1, mp_context=context, initializer=exit_with_parent,
                    initargs=(os.getpid(), 0.1),
                )
                print(pool.submit(os.getpid).result(), flush=True)
                pool.submit(time.sleep, 600)
                time.sleep(600)
            """
        )
    )
    harness = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(harness.stdout.readline())
        assert _running(worker)
    finally:
        harness.kill()  # SIGKILL: no handler, no cleanup in the harness
        harness.wait()
        harness.stdout.close()
    deadline = time.monotonic() + 60
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _running(worker):
        os.kill(worker, 9)
        pytest.fail(f"the pool worker {worker} outlived its killed harness by 60 s")
