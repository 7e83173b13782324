"""Child processes that end with their parent: no producer or vLLM server outlives the trainer.

A producer process used to look for its parent only at heartbeats, so during a long decoding step
(or a hung engine call) it outlived a SIGKILLed trainer, holding memory and, with vLLM, a GPU.
:func:`die_with_parent` makes the calling process end within ``poll_seconds`` of its parent's
death whatever its main thread is doing:

- on Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the process the moment its
  parent exits (strictly: the moment the parent *thread* that started it exits, so children must be
  started from a thread that lives as long as the trainer — the data modules start them from the
  main thread);
- everywhere, a daemon watchdog thread that polls ``os.getppid()`` and ends the process (or, with
  ``kill_group``, its whole process group, which is how a vLLM API server takes its engine
  processes with it) when the parent changed. The thread needs the GIL, which engines release in
  their kernels.

A parent that died before the call is caught too: the expected parent pid is passed in and
compared with ``os.getppid()`` at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

#: ``PR_SET_PDEATHSIG`` of ``<linux/prctl.h>``.
_PR_SET_PDEATHSIG = 1

#: Environment variable through which a launcher passes its pid to a child it starts.
PARENT_PID_ENV = "BRACE_PARENT_PID"


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the Linux kernel to send ``sig`` to this process when its parent exits; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _end(kill_group: bool, stop_signal: int | None = None, grace_seconds: float = 0.0) -> None:
    if stop_signal is not None:
        os.kill(os.getpid(), stop_signal)
        time.sleep(grace_seconds)
    if kill_group:
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(1)


def _watch(
    parent_pid: int,
    poll_seconds: float,
    kill_group: bool,
    stop_signal: int | None,
    grace_seconds: float,
) -> None:
    while True:
        time.sleep(poll_seconds)
        if os.getppid() != parent_pid:
            _end(kill_group, stop_signal, grace_seconds)


def die_with_parent(
    parent_pid: int,
    *,
    poll_seconds: float = 0.5,
    kill_group: bool = False,
    death_signal: bool = True,
    stop_signal: int | None = None,
    grace_seconds: float = 120.0,
) -> None:
    """End this process (or its process group) when ``parent_pid`` stops being its parent.

    Args:
        parent_pid: the pid of the process that started this one (passed in, not read here, so a
            parent that died before this call is noticed).
        poll_seconds: period of the watchdog thread.
        kill_group: end the whole process group (a server and the engine processes it started)
            rather than this process only; then no kernel death signal is set, since it would end
            this process before the watchdog could end the group.
        death_signal: also set Linux's ``PR_SET_PDEATHSIG`` (SIGKILL) when ``kill_group`` is False
            and no ``stop_signal`` is given.
        stop_signal: first send this process this signal (SIGTERM: a Lightning fit stops at its
            next batch, running its teardown and callbacks), and end it only ``grace_seconds``
            later if it still runs. Noticed by the watchdog only, so within ``poll_seconds``.
        grace_seconds: how long a ``stop_signal`` gets before the process is ended.
    """
    if death_signal and not kill_group and stop_signal is None:
        set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid and stop_signal is None:
        _end(kill_group)
    threading.Thread(
        target=_watch,
        args=(parent_pid, poll_seconds, kill_group, stop_signal, grace_seconds),
        name="parent-watchdog",
        daemon=True,
    ).start()
