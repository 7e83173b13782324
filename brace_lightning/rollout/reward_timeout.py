"""A reward that hangs cannot hang the run: verifier calls with a deadline (``reward_timeout``).

Math verifiers do hang on pathological answers (a symbolic simplification that never ends, a
catastrophic regular expression). With ``reward_timeout`` set, every call of the verifier (its
``__call__`` and ``is_correct`` on one sample, together) runs in a worker thread and the rollout
waits at most ``reward_timeout`` seconds for it; a call that runs past the deadline is abandoned,
its sample dropped and counted like a reward error (``dropped_reward_error``, so generated = trained
+ dropped still holds) and the next sample goes to a fresh worker thread.

Why a thread and not a process: a process could be killed, but the reward (often a closure or an
object holding a tokenizer or a client) would have to be picklable and every call would pay a round
trip to another process. A thread runs any reward as it is, in the same order as without a
timeout (one call at a time), but Python cannot stop a thread: an abandoned call keeps running
until it returns on its own. Abandoned threads are daemon threads (they never keep the interpreter
from exiting) and at most :data:`MAX_ABANDONED` of them may be alive at once in a process; the
call that would abandon one more ends the run with one sentence instead of piling up threads that
may each be burning a CPU core. ``reward_timeout=None`` (the default) calls the verifier inline,
exactly as before.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

#: Abandoned (timed-out, still running) reward threads a process may hold before the run stops.
MAX_ABANDONED = 8

#: Longest wait between two heartbeats while a call is awaited.
BEAT_SECONDS = 0.2

_abandoned: list[threading.Thread] = []
_abandoned_lock = threading.Lock()


class RewardTimeout(Exception):
    """A verifier call ran past ``reward_timeout`` and was abandoned (its sample is dropped)."""


class TooManyHungRewards(RuntimeError):
    """:data:`MAX_ABANDONED` abandoned verifier calls are still running: the run must stop."""


def check_reward_timeout(value: Any) -> float | None:
    """``value`` as seconds per sample (None = no timeout).

    Raises:
        ValueError: unless ``value`` is None or a finite number > 0.
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"reward_timeout must be None (no timeout) or a finite number of seconds > 0; "
            f"got {value!r}."
        )
    return float(value)


def abandoned_threads() -> int:
    """How many abandoned reward calls of this process are still running."""
    with _abandoned_lock:
        _abandoned[:] = [thread for thread in _abandoned if thread.is_alive()]
        return len(_abandoned)


class _Worker:
    """One daemon thread that runs submitted calls one after another."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._run, name="reward-call", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            future, fn, args = job
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # handed to the caller, which decides
                future.set_exception(error)


class RewardDeadline:
    """Runs verifier calls with a deadline of ``timeout`` seconds each (see the module docstring).

    Use as a context manager around the scoring of one batch: the worker thread ends with it.

    Args:
        timeout: seconds per call, from :func:`check_reward_timeout`.
        reward_name: names the verifier in errors.
        heartbeat: called about every :data:`BEAT_SECONDS` while a call is awaited (an async
            producer beats its heartbeat, so the trainer does not take a slow verifier, bounded by
            the deadline, for a hung producer).
    """

    def __init__(
        self, timeout: float, reward_name: str, heartbeat: Callable[[], None] | None = None
    ) -> None:
        self.timeout = timeout
        self.reward_name = reward_name
        self.heartbeat = heartbeat
        self._worker: _Worker | None = None

    def __enter__(self) -> RewardDeadline:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._worker is not None:
            self._worker.jobs.put(None)
            self._worker = None

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (its exceptions re-raised) if it returns within the deadline.

        Raises:
            RewardTimeout: when it did not; the call is abandoned and keeps running in its thread.
            TooManyHungRewards: when :data:`MAX_ABANDONED` abandoned calls are still running,
                before ``fn`` is started.
        """
        if self._worker is None:
            hung = abandoned_threads()
            if hung >= MAX_ABANDONED:
                raise TooManyHungRewards(
                    f"{hung} calls of the reward {self.reward_name} are still running after "
                    f"reward_timeout={self.timeout:g} s ran out and Python cannot stop a thread, "
                    "so the run stops instead of starting more; make the reward return (give it "
                    "its own time limit) or raise reward_timeout."
                )
            self._worker = _Worker()
        future: Future[T] = Future()
        self._worker.jobs.put((future, fn, args))
        end = time.monotonic() + self.timeout
        while not future.done() and (left := end - time.monotonic()) > 0:
            if self.heartbeat is not None:
                self.heartbeat()
            with contextlib.suppress(TimeoutError):
                future.exception(timeout=min(left, BEAT_SECONDS))
        if future.done():
            return future.result()  # its value, or the exception the reward raised
        with _abandoned_lock:
            _abandoned.append(self._worker.thread)
        self._worker.jobs.put(None)  # ends the thread if the call ever returns
        self._worker = None
        raise RewardTimeout(
            f"the reward {self.reward_name} did not return within reward_timeout={self.timeout:g} s"
        )
