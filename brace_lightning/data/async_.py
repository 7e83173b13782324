"""The asynchronous rollout data module: a producer generates while the trainer trains.

A producer (``rollout/workers.py``; a spawned process by default, so that a small machine really runs
generation and training on different cores) serves *requests*, one per rollout batch, with the
weights the trainer publishes after every step. This module decides what may be generated
(admission), receives finished batches into a :class:`~brace_lightning.rollout.buffer.StalenessBuffer`,
and hands them to the trainer in order, re-checking staleness when each is consumed.

Staleness (docs/conventions.md, "Versions and staleness"). With ``max_staleness = S``, batch ``n``
(consumed at rollout step ``n``) is requested only once ``n − S`` steps are complete and their weights
were sent, so at most ``S + 1`` batches are generated ahead of the trainer (AReaL's capacity rule)
and a sample's staleness ``trainer_version − min(token versions)`` is at most S by construction. It is
still checked at consume time: rows above S (a resume with a smaller S, a custom engine) are dropped
and counted as ``dropped_stale``. S = 0 is synchronous on-policy PPO — the producer idles while the
trainer trains — and yields exactly the batches of ``RolloutDataModule(lag=0)`` with the same seeds.

- ``lag: S`` (a fixed lag, spelled as ``RolloutDataModule``'s ``lag``): the producer handles
  commands strictly in order, so batch ``n`` is generated with the weights of version ``v(n − S)`` — exactly S versions behind the trainer once past the
  first S steps (and the critic warm-up) — whatever the timing: runs are reproducible and still
  overlap generation with training.
- ``lag: null`` (asynchronous, the default): the producer installs the newest weights it has before each batch, and with
  ``interruptible: true`` also between decoding steps, so a response may mix versions (recorded per
  token; the oldest one is the row's staleness). The key/value cache of the tokens sampled before a
  weight change is kept, as in vLLM without a pause; the recorded behavior log-probs are those of
  the distribution each token was actually drawn from, so importance weights stay exact.

Conservation, logged every step as ``count/*``: generated = trained + dropped_stale +
dropped_reward_error + dropped_empty + buffered (``buffered`` = rows of finished batches not yet
consumed). A checkpoint first waits for the requested batches to finish (at most S + 1), so it holds
every generated sample with its versions, the prompt stream and the engine's RNG: a resumed run
neither loses, duplicates nor regenerates a sample, and in fixed lag mode it is bit-identical.

The weights published after the last step admit S + 1 more batches; what of them finished before
``teardown`` is counted as ``buffered`` (and would be trained on first by a resumed run).

Faults: a producer that exits, raises (also while installing weights) or sends no heartbeat for
``producer_timeout`` seconds while the trainer waits on it raises an error in the trainer and the
producer is stopped; ``teardown`` (end of ``fit``) and ``on_exception`` (errors, Ctrl-C) stop it too.

A producer process is started with the ``spawn`` method, which re-imports the main module: a script
that trains with ``producer: process`` needs the usual ``if __name__ == "__main__":`` guard, and a
reward or engine class must be importable from a module (not defined in ``__main__`` or a notebook
cell); otherwise use ``producer: thread``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from brace_lightning.checks import require_bool, require_int
from brace_lightning.data.base import COUNTERS, EngineFactory, RolloutDataModuleBase
from brace_lightning.models.handoff import ActorHandoff
from brace_lightning.models.weight_sync import DEFAULT_BUCKET_MB, MIB
from brace_lightning.rollout.buffer import StalenessBuffer, batch_from_state, partial_groups
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.rollout.workers import (
    ProducerHandle,
    ProducerSpec,
    RolloutRequest,
    WeightSlots,
    build_engine,
    decode_batch,
    portable_factory,
)
from brace_lightning.tasks.base import PromptSource, RewardFunction
from brace_lightning.tasks.env import ToolEnvironment

logger = logging.getLogger(__name__)

ASYNC_COUNTERS = (*COUNTERS, "buffered")

#: A spawned producer must report ready within max(producer_timeout, this) seconds (imports, model).
STARTUP_SECONDS = 120.0

#: Longest single wait on the result queue between two health checks.
WAIT_SLICE_SECONDS = 0.1


class AsyncRolloutDataModule(RolloutDataModuleBase):
    """Rollout batches from a concurrent producer with staleness bounded by ``max_staleness``.

    Args:
        task: where prompts come from (e.g. ``brace_lightning.tasks.ArithmeticTask``); prompts are
            drawn in the training process, so a resumed run draws the same ones.
        reward: the verifier of single-turn responses (e.g.
            ``brace_lightning.tasks.ArithmeticReward``); runs in the producer. Must be None when
            ``env`` is set.
        env: a multi-turn tool environment (e.g. ``brace_lightning.tasks.CalculatorEnv``), run in
            the producer (so picklable for ``producer: process``): batches are then episodes of
            ``rollout.multiturn.collect_episodes`` scored by its verifier; None = single-turn.
        tokenizer: tokenizer source: ``"tiny-char"``, a local path or a hub name. Linked to
            ``model.actor`` by the CLI.
        engine: builds the rollout engine from an actor-shaped model (``class_path`` of an engine
            whose first argument is the model, e.g. ``brace_lightning.rollout.EmbeddedEngine``);
            None uses the embedded engine with its defaults.
        prompts_per_step: prompts per rollout batch.
        samples_per_prompt: responses per prompt (a group).
        max_staleness: S; no row with ``trainer_version − min(token versions) > S`` is trained on,
            and at most S + 1 batches are generated ahead of the trainer. 0 = synchronous on-policy.
        lag: None (asynchronous: the newest weights before each batch) or ``max_staleness`` (a
            fixed lag: the weights of exactly S versions ago, independent of timing).
        interruptible: (``lag`` None only) also install newer weights between decoding steps of in-flight
            responses, which then carry several versions; needs an engine whose ``generate`` takes
            ``on_step`` (the embedded engine does).
        producer: ``"process"`` (a spawned process that rebuilds the actor from its Hugging Face
            config and receives CPU weights) or ``"thread"`` (a thread of the training process, for
            engines that run elsewhere and for tests).
        producer_threads: torch threads of a producer process.
        producer_timeout: seconds without a heartbeat (one per decoding step, and while idle) after
            which a producer the trainer waits on is declared hung and an error is raised.
        seed: seed of the prompt draws (None: the run's ``seed_everything``, see
            ``brace_lightning.seeds``).
        val_batches: rollout batches per validation pass, generated in the training process with
            the current weights (not by the producer); 0 = no validation.
        max_consecutive_empty_batches: a batch with no sample left to train on (all dropped) is
            skipped and counted in ``count/empty_batches``; this many in a row stop the run.
        reward_timeout: seconds the verifier (``reward`` or ``env``) may take per sample; a call
            that does not return in time is abandoned (its thread keeps running, at most
            ``rollout.reward_timeout.MAX_ABANDONED`` of them) and its sample dropped and counted in
            ``dropped_reward_error``; a batch whose every sample timed out stops the run. None =
            no limit (the verifier is called inline).
    """

    def __init__(
        self,
        *,
        task: PromptSource,
        reward: RewardFunction | None = None,
        env: ToolEnvironment | None = None,
        tokenizer: str = "tiny-char",
        engine: EngineFactory | None = None,
        prompts_per_step: int = 16,
        samples_per_prompt: int = 4,
        max_staleness: int = 2,
        lag: int | None = None,
        interruptible: bool = False,
        producer: Literal["process", "thread"] = "process",
        producer_threads: int = 1,
        producer_timeout: float = 300.0,
        seed: int | None = None,
        val_batches: int = 0,
        max_consecutive_empty_batches: int = 10,
        reward_timeout: float | None = None,
    ) -> None:
        super().__init__(
            task=task,
            reward=reward,
            env=env,
            tokenizer=tokenizer,
            engine=engine,
            prompts_per_step=prompts_per_step,
            samples_per_prompt=samples_per_prompt,
            lag=lag,
            max_staleness=max_staleness,
            seed=seed,
            val_batches=val_batches,
            max_consecutive_empty_batches=max_consecutive_empty_batches,
            reward_timeout=reward_timeout,
        )
        require_int("max_staleness", max_staleness, 0)
        require_int("producer_threads", producer_threads, 1)
        if lag is not None and lag != max_staleness:
            raise ValueError(
                f"lag must be None (newest weights before each batch) or max_staleness="
                f"{max_staleness} (a fixed lag of exactly max_staleness versions); got {lag!r}."
            )
        if producer not in ("process", "thread"):
            raise ValueError(f"producer must be 'process' or 'thread'; got {producer!r}.")
        require_bool("interruptible", interruptible)
        if interruptible and lag is not None:
            raise ValueError(
                f"interruptible=True needs lag=None (newest weights); got lag={lag}, whose batches "
                "use exactly the weights of lag versions ago."
            )
        if isinstance(producer_timeout, bool) or not producer_timeout > 0:
            raise ValueError(f"producer_timeout must be > 0 seconds; got {producer_timeout!r}.")
        self.max_staleness: int = max_staleness
        self.interruptible = interruptible
        self.producer = producer
        self.producer_threads = producer_threads
        self.producer_timeout = float(producer_timeout)
        self.buffer = StalenessBuffer(max_staleness)
        self.counters: dict[str, int] = dict.fromkeys(ASYNC_COUNTERS, 0)
        #: ``{"pid": ..., "torch_threads": ...}`` once the producer reported ready.
        self.producer_info: dict[str, int] = {}
        self._granted = 0  # batches 0 … _granted − 1 were requested
        self._received = 0  # … and 0 … _received − 1 arrived (one FIFO producer: in order)
        self._consumed = 0  # … and 0 … _consumed − 1 were handed to the trainer
        self._engine_state: dict[str, Any] | None = None  # after the last received batch
        self._handle: ProducerHandle | None = None
        self._started = False
        self._slots: WeightSlots | None = None  # the producer's weight slots while it runs
        self._first_return: float | None = None  # idle fractions count from the first batch on
        self._trainer_idle_total = 0.0
        self._producer_idle_total = 0.0
        self._spawn_early = False  # set by setup("fit"), used by connect

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self._spawn_early = stage == "fit" and self.producer == "process"

    def connect(self, handoff: ActorHandoff) -> None:
        """Keep the hand-off; a ``fit`` with a producer process spawns it now, so that its
        imports overlap with the rest of the fit start-up (the warm start). Its weights are sent
        with the first request, after ``on_fit_start``."""
        super().connect(handoff)
        if self._spawn_early and self._handle is None:
            self._spawn()

    def teardown(self, stage: str) -> None:
        self._shutdown()

    def on_exception(self, exception: BaseException) -> None:
        self._shutdown(grace=0.0)

    def state_dict(self) -> dict[str, Any]:
        """Buffered batches (with versions), counters, prompt stream and the engine's RNG state.

        Waits first for every requested batch to arrive, so nothing is in flight.
        """
        if self._started:
            self._wait(lambda: self._received == self._granted, "checkpointing in-flight batches")
        return self._gather_rank_states(self._local_state_dict())

    def _local_state_dict(self) -> dict[str, Any]:
        return {
            "generator": self._generator.get_state(),
            "next_group": self._next_group,
            "granted": self._granted,
            "consumed": self._consumed,
            "trainer_version": self.trainer_version,
            "counters": dict(self.counters),
            "buffer": self.buffer.state_dict(),
            "engine": self._engine_state,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; must come before the first batch is requested."""
        if self._started:
            raise RuntimeError(
                "AsyncRolloutDataModule.load_state_dict was called after the producer started; "
                "expected it before the first batch."
            )
        state_dict = self._rank_state(state_dict)
        self._generator.set_state(state_dict["generator"])
        self._next_group = int(state_dict["next_group"])
        self._granted = self._received = int(state_dict["granted"])
        self._consumed = int(state_dict["consumed"])
        self.trainer_version = int(state_dict["trainer_version"])
        self.counters = {**dict.fromkeys(ASYNC_COUNTERS, 0), **state_dict["counters"]}
        self.buffer.load_state_dict(state_dict["buffer"])
        self._engine_state = state_dict["engine"]
        assert self.counters["buffered"] == self.buffer.num_samples, "checkpoint is inconsistent"

    # ------------------------------------------------------------------ producer life cycle

    @property
    def producer_pid(self) -> int | None:
        """Pid of the producer process (None before it is spawned, after it stopped, for threads)."""
        return None if self._handle is None else self._handle.pid

    def _spec(self) -> ProducerSpec:
        return ProducerSpec(
            engine_factory=portable_factory(self.engine_factory),
            tokenizer=self.tokenizer_source,
            reward=self.reward,
            env=self.env,
            samples_per_prompt=self.samples_per_prompt,
            exact_versions=self.lag is not None,
            interruptible=self.interruptible,
            torch_threads=self.producer_threads,
            seed_offset=0 if self.trainer is None else self.trainer.global_rank,
            reward_timeout=self.reward_timeout,
        )

    def _spawn(self) -> None:
        handoff = self.handoff
        if self.producer == "thread":
            engine = build_engine(self._spec(), handoff.engine_model())
            self._handle = ProducerHandle.thread(self._spec(), engine)
            return
        if handoff.config is None:
            raise ValueError(
                f"producer='process' rebuilds the actor from its Hugging Face config, but the actor "
                f"({handoff.actor_name}) has none; expected a transformers model, or use "
                "producer='thread'."
            )
        self._handle = ProducerHandle.spawn(self._spec(), handoff.config)

    def start(self, actor: nn.Module | None = None) -> None:
        """Start producing with the connected actor's current weights as version
        ``trainer_version``.

        Called by the first :meth:`next_batch`; to use the module without a Trainer, call it
        yourself with the ``actor`` (connected with the default bucket size).
        """
        if self._started:
            return
        if actor is not None:
            self.connect(ActorHandoff(actor, bucket_bytes=DEFAULT_BUCKET_MB * MIB))
        if self._handle is None:
            self._spawn()
        assert self._handle is not None
        # Under FSDP every rank takes part in the gather and gets the full weights (each rank's
        # producer needs them), a bucket at a time straight into the first slot.
        self._slots = WeightSlots(
            self.handoff.template(), self._slot_count(), shared=self.producer == "process"
        )
        slot = self._slots.fill_buckets(self.handoff.buckets())
        self._handle.send(
            ("init", self.trainer_version, self._slots.tensors, slot, self._engine_state)
        )
        self._started = True
        self._first_return = None
        self._throughput.reset()
        self._trainer_idle_total = self._producer_idle_total = 0.0

    def _shutdown(self, grace: float = 10.0) -> None:
        """Stop the producer (killed after ``grace`` s); finished batches it still sent are kept,
        in-flight ones dropped."""
        handle, self._handle = self._handle, None
        self._started = False
        self._slots = None
        if handle is None:
            return
        for message in handle.stop(grace):
            if message[0] == "batch":
                self._on_message(message)
        if self._granted > self._received:
            logger.info(
                "Stopped the rollout producer; %d requested batches were not generated.",
                self._granted - self._received,
            )
        self._granted = self._received

    # ------------------------------------------------------------------ weights and versions

    def publish(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        """The trainer finished version ``version``: copy ``buckets`` (its full state dict) into a
        free weight slot as they arrive, send it to the producer, request more batches. The caller
        runs the stream to its end afterwards.

        Raises:
            ValueError: when ``version`` does not increase, or a key or shape differs from the
                actor's (or keys are missing); the slot stays free.
            RuntimeError: when the producer died or failed (for example installing weights).
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"publish got version={version!r}; expected an integer.")
        if version <= self.trainer_version:
            raise ValueError(
                f"publish got version={version}; expected a version above the last one "
                f"({self.trainer_version})."
            )
        if self._started:
            assert self._handle is not None and self._slots is not None
            slots = self._slots
            self._pump(0)
            self._check_health(f"publishing version {version}")
            if not slots.has_free:  # an engine without decoding-step hooks frees slots per batch
                entered = time.monotonic()
                self._wait(
                    lambda: slots.has_free, f"waiting for a free weight slot for version {version}"
                )
                if self._first_return is not None:
                    self._trainer_idle_total += time.monotonic() - entered
            self._handle.send(("weights", version, slots.fill_buckets(buckets)))
        self.trainer_version = version
        if self._started:
            self._grant()

    def _slot_count(self) -> int:
        """Weight slots the producer can hold without making the trainer wait.

        In fixed lag mode up to S versions queue behind the one being generated with; in async mode
        the producer frees a staged version as soon as a newer one arrives (at every decoding step of
        a hooked engine), so three slots suffice: installed-from, staged, being filled.
        """
        if self.lag is not None:
            return self.max_staleness + 2
        return min(self.max_staleness + 2, 3)

    def _grant(self) -> None:
        """Request every batch admissible now that ``_consumed`` steps are complete."""
        assert self._handle is not None
        limit = self.buffer.admissible(self._consumed)
        while self._granted < limit:
            prompts = self.task.sample(self.prompts_per_step, self._generator)
            request = RolloutRequest(
                index=self._granted,
                prompts=prompts,
                group_id_offset=self._group_id_offset(len(prompts)),
                version=self.trainer_version,
            )
            self._handle.send(("request", request))
            self._granted += 1

    # ------------------------------------------------------------------ messages and health

    def _on_message(self, message: tuple) -> None:
        tag = message[0]
        if tag == "ready":
            assert self._handle is not None
            self._handle.ready = True
            self.producer_info = {"pid": int(message[1]), "torch_threads": int(message[2])}
        elif tag == "free":
            if self._slots is not None:  # None: a message from a stopped producer
                self._slots.release(int(message[1]))
        elif tag == "batch":
            _, index, payload = message
            state, engine_state = decode_batch(payload)
            assert index == self._received, f"rollout batch {index} arrived out of order"
            batch = batch_from_state(state)
            self.buffer.put(index, batch)
            self._received += 1
            self._engine_state = engine_state
            self.counters["generated"] += int(batch.info["generated"])
            self.counters["dropped_reward_error"] += int(batch.info["dropped_reward_error"])
            self.counters["buffered"] = self.buffer.num_samples
            if self._first_return is not None:  # not the start-up wait
                self._producer_idle_total += float(batch.info.get("producer_idle_s", 0.0))
        elif tag == "error":
            _, doing, text = message
            last = text.strip().splitlines()[-1] if text.strip() else "unknown error"
            self._fail(
                RuntimeError(
                    f"the rollout producer failed while {doing}: {last}\n\nProducer traceback:\n{text}"
                )
            )
        else:
            raise AssertionError(f"unknown producer message {tag!r}")

    def _pump(self, timeout: float) -> None:
        """Handle the producer's messages, waiting up to ``timeout`` s for the first one."""
        assert self._handle is not None
        message = self._handle.receive(timeout)
        while message is not None:
            self._on_message(message)
            message = self._handle.receive(0)

    def _check_health(self, doing: str) -> None:
        handle = self._handle
        assert handle is not None
        if not handle.is_alive():
            self._pump(0)  # an "error" message explains the exit better than the exit code
            self._fail(
                RuntimeError(
                    f"the rollout producer (pid {handle.pid}) exited with code {handle.exitcode} "
                    f"while the trainer was {doing}; expected it to run until teardown."
                )
            )
        limit = (
            self.producer_timeout if handle.ready else max(self.producer_timeout, STARTUP_SECONDS)
        )
        silent = handle.seconds_since_heartbeat()
        if silent > limit:
            self._fail(
                TimeoutError(
                    f"the rollout producer (pid {handle.pid}) sent no heartbeat for {silent:.1f} s "
                    f"while the trainer was {doing}; expected one within producer_timeout="
                    f"{self.producer_timeout:g} s (it is hung, or a decoding step is that slow)."
                )
            )

    def _wait(self, done: Callable[[], bool], doing: str) -> None:
        while True:
            self._pump(0)
            if done():
                return
            self._check_health(doing)
            self._pump(WAIT_SLICE_SECONDS)

    def _fail(self, error: Exception) -> None:
        self._shutdown(grace=0.0)  # dead, failed or hung: nothing to wait for
        raise error

    # ------------------------------------------------------------------ batches

    def next_batch(self) -> RolloutBatch:
        """The next rollout batch with a sample to train on; empty ones are skipped and counted
        (:class:`~brace_lightning.data.empty.EmptyBatchGuard`)."""
        while self._empty.skip(batch := self._consume_batch(), self.counters):
            pass
        return batch

    def _consume_batch(self) -> RolloutBatch:
        """The next rollout batch, staleness-checked against the current ``trainer_version``."""
        if not self._started:
            self.start()
        entered = time.monotonic()
        self._grant()
        index = self._consumed
        self._wait(lambda: index in self.buffer, f"waiting for rollout batch {index}")
        waited = time.monotonic() - entered
        batch, report = self.buffer.pop(index, self.trainer_version)
        self._consumed += 1
        self.counters["dropped_stale"] += report.dropped_stale
        self.counters["dropped_empty"] += report.dropped_empty
        self.counters["trained"] += len(batch)
        self.counters["buffered"] = self.buffer.num_samples
        if self._first_return is not None:  # the first wait is start-up, not idleness
            self._trainer_idle_total += waited
        elapsed = max(time.monotonic() - (self._first_return or time.monotonic()), 1e-9)
        staleness = report.staleness.float()
        mixed = (  # versions are -1 off actions; a batch that lost every row may have no columns
            batch.versions.amax(dim=1) != batch.min_versions()
            if batch.versions.shape[1]
            else torch.zeros(len(batch), dtype=torch.bool)
        )
        info: dict[str, float] = {
            "staleness_mean": float(staleness.mean()) if len(batch) else 0.0,
            "staleness_max": float(staleness.max()) if len(batch) else 0.0,
            **{
                f"staleness_frac/{k}": float((report.staleness == k).float().mean())
                if len(batch)
                else 0.0
                for k in range(self.max_staleness + 1)
            },
            "mixed_version_fraction": float(mixed.float().mean()) if len(batch) else 0.0,
            "trainer_version": float(self.trainer_version),  # at consume time
            "queue_depth": float(self.buffer.num_batches),
            "in_flight": float(self._granted - self._received),
            "trainer_idle_s": waited,
            "trainer_idle_fraction": self._trainer_idle_total / elapsed,
            "producer_idle_fraction": min(1.0, self._producer_idle_total / elapsed),
            **{f"count/{name}": float(value) for name, value in self.counters.items()},
        }
        info.update(self._throughput.hand_out(entered, batch.num_actions))
        if partial := partial_groups(batch.group_ids, self.samples_per_prompt):
            info["partial_groups"] = float(partial)
        batch.info.update(info)
        if self._first_return is None:
            self._first_return = time.monotonic()
        return batch
