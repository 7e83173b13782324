"""Rollout producers: an engine that generates next to the trainer, in a spawned process or a thread.

A producer owns one engine and serves *requests* (prompts of one rollout batch) with whatever weights
the trainer has sent it, scoring completions with the reward function and padding them
(:func:`~brace_lightning.rollout.collect.collect_rollouts`, or the multi-turn episodes of
:func:`~brace_lightning.rollout.multiturn.collect_episodes` when the spec has an environment). The trainer's side is a
:class:`ProducerHandle`; the admission rule that bounds staleness lives with the trainer (see
``rollout/buffer.py``): a producer never decides what to generate.

Protocol (two FIFO queues; tuples tagged by their first item)::

    trainer → producer   ("init", version, slots, slot, engine_state)  first: the weight slots, the
                                                       one holding ``version``, the RNG state
                         ("weights", version, slot)    slot ``slot`` now holds a new policy version
                         ("request", RolloutRequest)   generate one rollout batch
                         ("stop",)                     exit now, drop in-flight work
    producer → trainer   ("ready", pid, torch_threads)
                         ("free", slot)                the engine installed (or skipped) that slot
                         ("batch", index, payload)     payload: torch.save bytes of
                                                       (batch_state, engine_state), see decode_batch
                         ("error", what it was doing, traceback)

Weights travel through :class:`WeightSlots`: a few CPU copies of the actor's state dict, allocated
once (in shared memory for a process producer) and sent once with ``"init"``. Publishing a version
copies the weights into a free slot and sends the slot's index; the producer frees the slot once its
engine has installed it, or once a newer version superseded it. A fresh copy per version would cost
mostly page faults of new memory, several times the copy itself. Batches travel as bytes: a tensor
shared by file descriptor can only be received while its sender is alive, and a batch must stay
readable after its producer died.

Which weights serve a request:

- ``exact_versions=True`` (a fixed ``lag``): commands are handled strictly in order, so a request
  is served with exactly the weights sent before it — the trainer's version when it was granted —
  and the samples do not depend on timing;
- otherwise (``lag: null``): the newest weights received are installed before each request and,
  with ``interruptible=True``, between decoding steps (engines whose ``generate`` takes an ``on_step``
  hook), so one response may carry several versions, recorded per token.

A spawned producer builds its engine from the actor's Hugging Face config and reads the weights from
the shared-memory slots (the LightningModule is never pickled). It uses ``torch_threads`` threads,
ignores SIGINT and SIGTERM (:data:`STOP_SIGNALS`; the trainer stops it: Ctrl-C, ``scancel`` and
systemd signal the whole process group, and a producer that died first would cost the trainer the
step it is finishing), and ends with the
training process even in the middle of a decoding step or a hung engine call
(``rollout/orphans.py``: Linux's parent-death signal and a watchdog thread). It beats a heartbeat at every decoding step and while idle, so
the trainer tells a hung producer from a slow one.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import io
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp
from torch import nn
from transformers import PretrainedConfig

from brace_lightning.models.policy import load_causal_lm
from brace_lightning.models.sources import load_tokenizer
from brace_lightning.rollout.buffer import batch_to_state
from brace_lightning.rollout.embedded import EmbeddedEngine
from brace_lightning.rollout.engine import (
    GenerationOutput,
    RolloutEngine,
    accepts_extra_stops,
    check_state_dict,
    copy_buckets,
)
from brace_lightning.rollout.multiturn import collect_batch
from brace_lightning.rollout.orphans import die_with_parent
from brace_lightning.tasks.base import Prompt, RewardFunction
from brace_lightning.tasks.env import ToolEnvironment

EngineFactory = Callable[[nn.Module], RolloutEngine]

#: Seconds between two looks at the command queue while idle (also the heartbeat period then).
POLL_SECONDS = 0.2
#: Signals a producer process ignores: sent to a whole process group (Ctrl-C, ``scancel``,
#: systemd), they are the trainer's to handle; it stops the producer itself.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class RolloutRequest:
    """Generate rollout batch ``index`` (the one the trainer consumes at rollout step ``index``).

    Args:
        index: position of the batch in the trainer's consumption order.
        prompts: the prompts (drawn by the trainer, so a resumed run draws the same ones).
        group_id_offset: added to the prompt index to form the batch's ``group_ids``.
        version: the trainer's policy version when the request was granted; its weights were sent
            before the request, so the producer holds at least this version when it starts.
    """

    index: int
    prompts: list[Prompt]
    group_id_offset: int
    version: int


@dataclass(frozen=True)
class ProducerSpec:
    """What a producer needs besides the weights (picklable: it is sent to a spawned process).

    Args:
        engine_factory: builds the engine from an actor-shaped model (None = ``EmbeddedEngine``).
        tokenizer: tokenizer source (``load_tokenizer``), used to encode prompts and decode answers.
        reward: the verifier of single-turn responses (None when ``env`` is set).
        samples_per_prompt: responses per prompt.
        exact_versions: serve each request with exactly the weights sent before it (fixed lag).
        interruptible: install newer weights between decoding steps (async only).
        torch_threads: ``torch.set_num_threads`` of a spawned producer.
        env: multi-turn tool environment (episodes of ``collect_episodes``); None = single-turn.
        seed_offset: the engine samples from ``seed + seed_offset`` (the data-parallel rank).
        reward_timeout: seconds the verifier may take per sample before the sample is dropped
            (None = no limit; ``rollout/reward_timeout.py``).
    """

    engine_factory: EngineFactory | None
    tokenizer: str
    reward: RewardFunction | None
    samples_per_prompt: int
    exact_versions: bool
    interruptible: bool
    torch_threads: int = 1
    env: ToolEnvironment | None = None
    seed_offset: int = 0
    reward_timeout: float | None = None


def portable_factory(factory: EngineFactory | None) -> EngineFactory | None:
    """``factory`` without what a spawned process must not receive.

    LightningCLI's engine factories are jsonargparse partials that also carry the CLI's class
    instantiators, which hold the CLI and with it the LightningModule; an engine class needs none of
    them, so such a partial becomes ``functools.partial(EngineClass, *args, **init_args)``. Any other
    factory is returned as is.
    """
    if (
        isinstance(factory, functools.partial)
        and getattr(factory.func, "__name__", "") == "call_without_instantiate_context"
        and len(factory.args) >= 2
        and isinstance(factory.args[1], type)
    ):
        return functools.partial(factory.args[1], *factory.args[2:], **factory.keywords)
    return factory


class _NoModulePickler(pickle.Pickler):
    """Refuses ``nn.Module`` objects: the producer rebuilds the actor from its config."""

    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, nn.Module):
            raise pickle.PicklingError(f"it holds a torch module ({type(obj).__name__})")
        return None


def build_engine(spec: ProducerSpec, model: nn.Module) -> RolloutEngine:
    """The engine of ``spec`` built around ``model`` (which the embedded engine deep-copies)."""
    engine = (spec.engine_factory or EmbeddedEngine)(model)
    if spec.seed_offset:
        engine.offset_seed(spec.seed_offset)
    return engine


def accepts_step_hook(engine: RolloutEngine) -> bool:
    """Whether ``engine.generate`` takes the ``on_step`` hook (needed by interruptible generation)."""
    return "on_step" in inspect.signature(engine.generate).parameters


class _Queue(Protocol):
    def put(self, item: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...

    def get_nowait(self) -> Any: ...


class _Beat:
    """A heartbeat cell for thread producers (``mp.Value("d")`` plays this role across processes)."""

    def __init__(self) -> None:
        self.value = time.monotonic()


class _Stop(Exception):
    """The trainer asked the producer to stop, or the training process is gone."""


class _HookedEngine(RolloutEngine):
    """Passes ``on_step`` (and ``extra_stop_token_ids``) to an engine that accepts it, so
    ``collect_rollouts`` and ``collect_episodes`` need no hook."""

    def __init__(self, engine: RolloutEngine, on_step: Callable[[], None]) -> None:
        self.engine = engine
        self.on_step = on_step if accepts_step_hook(engine) else None
        self.temperature = engine.temperature

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(
        self,
        prompts: list[list[int]],
        *,
        num_samples: int = 1,
        extra_stop_token_ids: Sequence[int] = (),
    ) -> GenerationOutput:
        kwargs: dict[str, Any] = {}
        if self.on_step is not None:
            kwargs["on_step"] = self.on_step
        if extra_stop_token_ids and accepts_extra_stops(self.engine):
            kwargs["extra_stop_token_ids"] = extra_stop_token_ids
        return self.engine.generate(prompts, num_samples=num_samples, **kwargs)

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(weights, version)


class WeightSlots:
    """Reusable CPU copies of a state dict that carry policy versions to a producer.

    The trainer owns the slots: :meth:`fill` copies weights into a free one, :meth:`release` takes
    it back when the producer reports it free. A slot's tensors are written only while it is free, so
    the producer never reads a half-written version.

    Args:
        weights: the actor's state dict (names, shapes and dtypes of the slots).
        count: number of slots (at least 1).
        shared: allocate in shared memory (for a spawned producer).
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], count: int, *, shared: bool) -> None:
        if count < 1:
            raise ValueError(f"WeightSlots needs count >= 1; got {count}.")
        self.tensors: list[dict[str, torch.Tensor]] = []
        for _ in range(count):
            slot = {
                name: torch.empty(tuple(value.shape), dtype=value.dtype)
                for name, value in weights.items()
            }
            if shared:
                for tensor in slot.values():
                    tensor.share_memory_()
            self.tensors.append(slot)
        self._free = deque(range(count))

    @property
    def has_free(self) -> bool:
        return bool(self._free)

    def check(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` (from ``publish``) unless ``weights`` has the slots' names and shapes."""
        check_state_dict(weights, self.tensors[0], caller="publish")

    def fill(self, weights: Mapping[str, torch.Tensor]) -> int:
        """Copy ``weights`` (which passed :meth:`check`, or made the slots) into a free slot (there
        must be one) and return its index."""
        index = self._free.popleft()
        with torch.no_grad():
            for name, tensor in self.tensors[index].items():
                tensor.copy_(weights[name].detach())
        return index

    def fill_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> int:
        """:meth:`fill` from a stream of buckets that together are the full state dict (there
        must be a free slot); each bucket is copied in as it arrives.

        Raises:
            ValueError: (from ``publish``) for a name that is not a slot's or arrives twice, a
                shape that differs, or names missing at the end; the slot stays free.
        """
        index = self._free.popleft()
        slot = self.tensors[index]
        try:
            copy_buckets(buckets, slot, caller="publish")
        except BaseException:
            self._free.appendleft(index)
            raise
        return index

    def release(self, index: int) -> None:
        if index in self._free or not 0 <= index < len(self.tensors):
            raise AssertionError(f"weight slot {index} was freed twice or does not exist")
        self._free.append(index)


class Producer:
    """The producer's loop (runs in a spawned process or a thread); see the module docstring.

    Args:
        spec: engine, verifier and version rules.
        engine: the engine to sample with.
        commands: the trainer → producer queue.
        results: the producer → trainer queue.
        heartbeat: a cell whose ``value`` the producer sets to ``time.monotonic()`` while alive.
        parent_pid: pid of the training process (a spawned producer exits when it changes); None
            for a thread.
    """

    def __init__(
        self,
        spec: ProducerSpec,
        engine: RolloutEngine,
        *,
        commands: _Queue,
        results: _Queue,
        heartbeat: Any,
        parent_pid: int | None,
    ) -> None:
        self.spec = spec
        self.engine = engine
        self.tokenizer = load_tokenizer(spec.tokenizer)
        self.commands = commands
        self.results = results
        self.heartbeat = heartbeat
        self.parent_pid = parent_pid
        self._inbox: deque[tuple] = deque()  # requests (and, with exact versions, weights) in order
        self._slots: list[dict[str, torch.Tensor]] = []  # WeightSlots.tensors, sent with "init"
        self._staged: tuple[int, int] | None = None  # (version, slot) of the newest weights (async)
        self._idle_since = time.monotonic()
        self._doing = "waiting for the first command"

    def run(self) -> None:
        """Serve commands until ``("stop",)``; report an exception as an ``"error"`` message."""
        try:
            self.results.put(("ready", os.getpid(), torch.get_num_threads()))
            while True:
                self._serve_one()
        except _Stop:
            return
        except BaseException:  # every failure must reach the trainer
            self.results.put(("error", self._doing, traceback.format_exc()))

    # ------------------------------------------------------------------ commands

    def _serve_one(self) -> None:
        if not self._inbox and self._staged is None:
            self._receive(block=True)
        self._receive(block=False)
        if self._staged is not None:
            self._install(*self._staged)
            self._staged = None
        if not self._inbox:
            return
        command = self._inbox.popleft()
        if command[0] == "weights":
            self._install(command[1], command[2])
        else:
            self._generate(command[1])

    def _receive(self, *, block: bool) -> None:
        """Move available commands into the inbox (blocking until one arrives when ``block``)."""
        while True:
            self._beat()
            try:
                command = (
                    self.commands.get(timeout=POLL_SECONDS) if block else self.commands.get_nowait()
                )
            except queue.Empty:
                if block:
                    continue
                return
            block = False
            tag = command[0]
            if tag == "stop":
                raise _Stop
            if tag == "init":
                _, version, self._slots, slot, engine_state = command
                if engine_state is not None:
                    self._doing = "restoring the engine state"
                    self.engine.load_state_dict(engine_state)
                command = ("weights", version, slot)
                tag = "weights"
            if tag == "weights" and not self.spec.exact_versions:
                if self._staged is not None:  # only the newest weights matter
                    self.results.put(("free", self._staged[1]))
                self._staged = (command[1], command[2])
            else:
                self._inbox.append(command)

    def _install(self, version: int, slot: int) -> None:
        self._doing = f"installing the weights of version {version}"
        self.engine.update_weights(self._slots[slot], version)  # engines copy what they keep
        self.results.put(("free", slot))
        self._doing = f"idle with the weights of version {version}"

    def _beat(self) -> None:
        self.heartbeat.value = time.monotonic()
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            raise _Stop

    def _on_step(self) -> None:
        """Between decoding steps: heartbeat, stop requests and (interruptible) newer weights."""
        self._receive(block=False)
        if self.spec.interruptible and self._staged is not None:
            version, slot = self._staged
            self._staged = None
            doing = self._doing
            self._install(version, slot)
            self._doing = doing

    # ------------------------------------------------------------------ generation

    def _generate(self, request: RolloutRequest) -> None:
        version = self.engine.version
        if version < request.version or (self.spec.exact_versions and version != request.version):
            raise RuntimeError(
                f"rollout batch {request.index} was granted at version {request.version} but the "
                f"engine holds version {version} (a bug in the producer's command order)."
            )
        self._doing = f"generating rollout batch {request.index} with version {version}"
        idle = time.monotonic() - self._idle_since
        batch = collect_batch(
            _HookedEngine(self.engine, self._on_step),
            request.prompts,
            self.tokenizer,
            reward=self.spec.reward,
            env=self.spec.env,
            num_samples=self.spec.samples_per_prompt,
            group_id_offset=request.group_id_offset,
            reward_timeout=self.spec.reward_timeout,
            heartbeat=self._beat,  # a verifier call, bounded by reward_timeout, is not a hang
        )
        batch.info.update(
            temperature=float(self.engine.temperature),
            engine_version=float(self.engine.version),
            producer_idle_s=idle,
        )
        payload = io.BytesIO()
        torch.save((batch_to_state(batch), self.engine.state_dict()), payload)
        self.results.put(("batch", request.index, payload.getvalue()))
        self._idle_since = time.monotonic()
        self._doing = f"idle after rollout batch {request.index}"


def decode_batch(payload: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(batch_state, engine_state)`` of a ``("batch", index, payload)`` message."""
    return torch.load(io.BytesIO(payload), weights_only=False)  # written by our own producer


#: glibc ``mallopt`` parameters (malloc.h) and the values a producer process runs with.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest; the dynamic rule would reach it only slowly
_TRIM_THRESHOLD_BYTES = 256 << 20


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse in this process; False where the C library is not glibc.

    Decoding allocates and frees tensors of the same few sizes at every step (activations, logits,
    and per batch the key/value cache). A fresh process serves them from ``mmap`` and returns the freed top of its heap to the
    system, so every step pays page faults again; a training process has long raised glibc's dynamic
    thresholds by freeing larger tensors. Fixing the thresholds gives the producer that state from
    the start: on the 2-core benchmark machine the producer generated 40-65% slower without it
    (``benchmarks/async_speedup.py``, generate s of async S = 0 against sync).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )


def _process_main(
    spec: ProducerSpec,
    model_config: PretrainedConfig,
    commands: _Queue,
    results: _Queue,
    heartbeat: Any,
    parent_pid: int,
) -> None:
    """Entry point of a spawned producer: build the engine from the config, then serve."""
    die_with_parent(parent_pid)  # gone within a second of the trainer, whatever the engine does
    for sig in STOP_SIGNALS:  # also set before the spawn; kept ignored whatever the start did
        signal.signal(sig, signal.SIG_IGN)
    keep_freed_memory()
    torch.set_num_threads(spec.torch_threads)
    try:
        model = load_causal_lm(model_config)
        engine = build_engine(spec, model)
        del model
        producer = Producer(
            spec,
            engine,
            commands=commands,
            results=results,
            heartbeat=heartbeat,
            parent_pid=parent_pid,
        )
    except BaseException:  # reported to the trainer
        results.put(("error", "building the engine", traceback.format_exc()))
        return
    producer.run()


class ProducerHandle:
    """The trainer's end of one producer: its queues, heartbeat and liveness.

    Build it with :meth:`spawn` (a process) or :meth:`thread` (a thread in the training process).
    """

    def __init__(
        self,
        *,
        commands: Any,
        results: Any,
        heartbeat: Any,
        worker: BaseProcess | threading.Thread,
    ) -> None:
        self.commands = commands
        self.results = results
        self.heartbeat = heartbeat
        self.worker = worker
        self.ready = False
        self.started_at = time.monotonic()

    @classmethod
    def spawn(cls, spec: ProducerSpec, model_config: PretrainedConfig) -> ProducerHandle:
        """Start a producer process (spawn context) that builds its engine from ``model_config``.

        Raises:
            ValueError: when ``spec`` (engine factory, reward, environment) cannot be pickled.
        """
        try:
            _NoModulePickler(io.BytesIO()).dump((spec, model_config))
        except Exception as error:
            raise ValueError(
                f"producer='process' sends the engine factory, the reward and the environment to a "
                f"new process, but they cannot be pickled without the model ({error}); expected picklable objects "
                "that hold no torch module, or use producer='thread'."
            ) from error
        context = mp.get_context("spawn")
        commands, results = context.Queue(), context.Queue()
        heartbeat = context.Value("d", time.monotonic(), lock=False)
        process = context.Process(
            target=_process_main,
            args=(spec, model_config, commands, results, heartbeat, os.getpid()),
            name="rollout-producer",
            daemon=True,
        )
        # The child inherits SIGINT and SIGTERM ignored from birth: Ctrl-C, `scancel` and systemd
        # signal the whole process group, and the trainer, not the producer, decides when the
        # producer stops (after the step's checkpoint).
        previous: dict[int, Any] = {}
        with contextlib.suppress(ValueError):  # not the main thread: keep the handlers
            for sig in STOP_SIGNALS:
                previous[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            process.start()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return cls(commands=commands, results=results, heartbeat=heartbeat, worker=process)

    @classmethod
    def thread(cls, spec: ProducerSpec, engine: RolloutEngine) -> ProducerHandle:
        """Start a producer thread serving ``engine`` (for engines that run elsewhere, and tests)."""
        commands: queue.Queue = queue.Queue()
        results: queue.Queue = queue.Queue()
        heartbeat = _Beat()
        producer = Producer(
            spec, engine, commands=commands, results=results, heartbeat=heartbeat, parent_pid=None
        )
        worker = threading.Thread(target=producer.run, name="rollout-producer", daemon=True)
        worker.start()
        return cls(commands=commands, results=results, heartbeat=heartbeat, worker=worker)

    @property
    def pid(self) -> int | None:
        """The producer process's pid (None for a thread)."""
        return self.worker.pid if isinstance(self.worker, BaseProcess) else None

    @property
    def exitcode(self) -> int | None:
        """The process's exit code (None while alive, and for threads)."""
        return self.worker.exitcode if isinstance(self.worker, BaseProcess) else None

    def is_alive(self) -> bool:
        return self.worker.is_alive()

    def send(self, command: tuple) -> None:
        self.commands.put(command)

    def receive(self, timeout: float) -> tuple | None:
        """The next message, waiting up to ``timeout`` seconds (0 = only what is there); else None."""
        try:
            if timeout <= 0:
                return self.results.get_nowait()
            return self.results.get(timeout=timeout)
        except queue.Empty:
            return None

    def seconds_since_heartbeat(self) -> float:
        return time.monotonic() - float(self.heartbeat.value)

    def stop(self, grace: float = 10.0) -> list[tuple]:
        """Ask the producer to exit, wait up to ``grace`` s, then kill a process that is still alive
        (SIGKILL also ends a hung or SIGSTOP-ed one; a thread is left to finish as a daemon).

        Returns the messages that were still queued (drained so that the producer can exit).
        """
        leftover: list[tuple] = []
        with contextlib.suppress(Exception):  # a dead producer's queue may be broken
            self.send(("stop",))
        deadline = time.monotonic() + grace
        while self.worker.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                message = self.receive(0.05)
                if message is not None:
                    leftover.append(message)
        if isinstance(self.worker, BaseProcess):
            if self.worker.is_alive():
                self.worker.kill()
            self.worker.join(5.0)
            for channel in (self.commands, self.results):
                channel.cancel_join_thread()
                channel.close()
        return leftover
