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


def _first_line_pid(harness: subprocess.Popen) -> int:
    """The pid the harness's child prints first; the harness is killed if none comes."""
    try:
        return int(harness.stdout.readline())
    except ValueError:
        harness.kill()
        harness.wait()
        harness.stdout.close()
        raise


def _kill_and_wait_for(harness: subprocess.Popen, child: int, seconds: float) -> bool:
    """SIGKILL the harness (no handler, no cleanup in it); whether ``child`` ended within
    ``seconds`` (killed here if not)."""
    harness.kill()
    harness.wait()
    harness.stdout.close()
    deadline = time.monotonic() + seconds
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _running(child):
        os.kill(child, 9)
        return False
    return True


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
    worker = _first_line_pid(harness)
    assert _running(worker)
    assert _kill_and_wait_for(harness, worker, 60), f"the pool worker {worker} outlived its harness"


def _harness_running(tmp_path: Path, child: str) -> tuple[subprocess.Popen, int]:
    """A harness process that starts ``child`` (lines of Python run as the module ``follower``
    through ``benchmarks._follow``, with arguments ``a b``) and waits; returns the harness and the
    child's pid, which the child prints first."""
    (tmp_path / "follower.py").write_text(textwrap.dedent(child))
    harness = tmp_path / "harness.py"
    harness.write_text(
        textwrap.dedent(
            """
            import subprocess, sys, time
            subprocess.Popen([sys.executable, "-m", "benchmarks._follow", "follower", "a", "b"])
            time.sleep(600)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, str(harness)], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path
    )
    return process, _first_line_pid(process)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_followed_module_runs_as_main_and_gets_sigterm_when_its_harness_is_killed(tmp_path):
    harness, child = _harness_running(
        tmp_path,
        """
        import os, signal, sys, time
        from pathlib import Path

        def stopped(signum, frame):
            Path("stopped.txt").write_text(f"{__name__} {sys.argv[1:]}")
            sys.exit(0)

        signal.signal(signal.SIGTERM, stopped)
        print(os.getpid(), flush=True)
        time.sleep(600)
        """,
    )
    assert _running(child)
    assert _kill_and_wait_for(harness, child, 30), "the followed module outlived its harness"
    assert (tmp_path / "stopped.txt").read_text() == "__main__ ['a', 'b']"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_module_that_ignores_sigterm_still_exits_after_the_grace_period(tmp_path):
    harness, child = _harness_running(
        tmp_path,
        """
        import os, signal, time
        from benchmarks._common import stop_with_parent

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_with_parent(os.getppid(), poll_seconds=0.1, grace_seconds=1.0)
        print(os.getpid(), flush=True)
        time.sleep(600)
        """,
    )
    assert _kill_and_wait_for(harness, child, 30), "SIGTERM ignored, and no exit after the grace"


def test_cli_command_runs_the_real_cli_through_follow():
    from benchmarks._common import cli_command, subprocess_env

    command = cli_command(["fit", "--help"])
    assert command[1:4] == ["-m", "benchmarks._follow", "brace_lightning.cli"]
    done = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "--config CONFIG" in done.stdout and "--model" in done.stdout


def test_follow_without_a_module_says_what_it_takes():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks._follow"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 1
    assert "takes the module to run" in done.stderr and "got no module" in done.stderr
