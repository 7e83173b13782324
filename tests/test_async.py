"""Asynchronous rollouts: staleness bound, fixed lag, conservation, resume, faults, S = 0 == sync.

The many-iteration timing tests run the real data module with a thread producer and a cheap fake
engine (random delays in producer and trainer); the slow ones spawn real producer processes with the
embedded engine and the tiny model.
"""

from __future__ import annotations

import contextlib
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from brace_lightning.cli import run
from brace_lightning.data import AsyncRolloutDataModule, RolloutDataModule
from brace_lightning.data import sync as sync_data
from brace_lightning.logs import read_scalars
from brace_lightning.models import load_tokenizer
from brace_lightning.models.handoff import ActorHandoff
from brace_lightning.models.sources import load_actor
from brace_lightning.rollout import EmbeddedEngine
from brace_lightning.rollout.buffer import split_stale
from brace_lightning.rollout.engine import GenerationOutput, RolloutEngine
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.rollout.workers import WeightSlots
from brace_lightning.tasks import ArithmeticReward, ArithmeticTask
from brace_lightning.tasks.base import Prompt, RewardFunction
from tests.test_trainer import (
    CONFIGS,
    actor_weights,
    small_run,
    stop_and_checkpoint_at,
)

ROOT = Path(__file__).resolve().parents[1]
TOKEN = load_tokenizer("tiny-char").convert_tokens_to_ids("1")


class ConstantReward(RewardFunction):
    """Scores every completion 1 (the fake engine's answers are meaningless)."""

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0


class FakeEngine(RolloutEngine):
    """Emits ``length`` tokens per sample with random delays between decoding steps.

    The behavior log-prob of every token is the first entry of the installed weights, so a test can
    tell which weights sampled it; ``calls`` records the prompts of every ``generate`` call.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        calls: list[list[list[int]]] | None = None,
        length: int = 4,
        max_delay: float = 0.0,
        fail_at_version: int | None = None,
        seed: int = 0,
    ) -> None:
        self._version = 0
        self._marker = 0.0
        self.calls = [] if calls is None else calls
        self.length = length
        self.max_delay = max_delay
        self.fail_at_version = fail_at_version
        self.random = random.Random(seed)

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self._version = version
        self._marker = float(next(iter(weights.values())).flatten()[0])

    def generate(
        self,
        prompts: list[list[int]],
        *,
        num_samples: int = 1,
        on_step: Callable[[], None] | None = None,
    ) -> GenerationOutput:
        if self.fail_at_version is not None and self._version >= self.fail_at_version:
            raise RuntimeError("fake engine exploded")
        self.calls.append(prompts)
        n = len(prompts) * num_samples
        versions: list[int] = []
        markers: list[float] = []
        for step in range(self.length):
            if step:
                time.sleep(self.random.uniform(0.0, self.max_delay))
                if on_step is not None:
                    on_step()
            versions.append(self._version)
            markers.append(self._marker)
        return GenerationOutput(
            prompt_ids=[list(p) for p in prompts for _ in range(num_samples)],
            response_ids=[[TOKEN] * self.length for _ in range(n)],
            logprobs=[list(markers) for _ in range(n)],
            versions=[list(versions) for _ in range(n)],
            prompt_index=[i for i in range(len(prompts)) for _ in range(num_samples)],
            finish_reason=["length"] * n,
        )


def weights_of(version: int) -> dict[str, torch.Tensor]:
    """Actor-shaped weights whose first entry names the version (read back by ``FakeEngine``)."""
    return {"weight": torch.full((2, 2), float(version)), "bias": torch.zeros(2)}


FAKE_ACTOR = nn.Linear(2, 2)
FAKE_ACTOR.load_state_dict(weights_of(0))


def fake_module(
    engine_factory: Callable[[nn.Module], RolloutEngine], *, start: bool = True, **kwargs
) -> AsyncRolloutDataModule:
    """A thread-producer data module over ``engine_factory``, started with version-0 weights."""
    options = dict(
        task=ArithmeticTask(),
        reward=ConstantReward(),
        engine=engine_factory,
        prompts_per_step=2,
        samples_per_prompt=2,
        producer="thread",
        producer_timeout=30.0,
    )
    options.update(kwargs)
    dm = AsyncRolloutDataModule(**options)
    if start:
        dm.start(FAKE_ACTOR)
    return dm


def assert_conserved(dm: AsyncRolloutDataModule, batch: RolloutBatch) -> None:
    c = dm.counters
    dropped = c["dropped_stale"] + c["dropped_reward_error"] + c["dropped_empty"]
    assert c["generated"] == c["trained"] + dropped + c["buffered"], c
    assert c["buffered"] == dm.buffer.num_samples
    for name, value in c.items():
        assert batch.info[f"count/{name}"] == value, name


# ---------------------------------------------------------------------------- timing (fast)


@pytest.mark.parametrize(
    ("max_staleness", "lag", "interruptible"),
    [
        (0, None, False),
        (1, None, False),
        (2, None, True),
        (3, None, True),
        (2, 2, False),
    ],
)
def test_staleness_bound_and_conservation_under_random_timing(max_staleness, lag, interruptible):
    rng = random.Random(max_staleness)
    factory = partial(FakeEngine, max_delay=0.0015, seed=max_staleness)
    dm = fake_module(factory, max_staleness=max_staleness, lag=lag, interruptible=interruptible)
    warmup, steps = 5, 150
    version_after = [0]  # version_after[c] = trainer version once c steps are complete
    mixed_rows = 0
    try:
        for step in range(steps):
            batch = dm.next_batch()
            staleness = dm.trainer_version - batch.min_versions()
            assert int(staleness.max()) <= max_staleness
            assert batch.info["staleness_max"] == float(staleness.max())
            assert batch.info["in_flight"] + batch.info["queue_depth"] <= max_staleness
            actions = batch.versions[batch.mask]
            if lag is not None or max_staleness == 0:
                # exactly the weights published S steps ago (tags and the weights themselves)
                behavior = version_after[max(0, step - max_staleness)]
                assert (actions == behavior).all()
                assert (batch.behavior_logprobs[batch.mask] == behavior).all()
            mixed = batch.versions.amax(dim=1) != batch.min_versions()
            mixed_rows += int(mixed.sum())
            assert batch.info["mixed_version_fraction"] == float(mixed.float().mean())
            # every token was drawn with the weights of the version it records (no torn slot)
            assert (batch.behavior_logprobs[batch.mask] == actions.float()).all()
            assert batch.info["generate_s"] > 0 and batch.info["gen_tokens_per_s"] > 0
            assert 0.0 <= batch.info["trainer_idle_fraction"] <= 1.0
            assert 0.0 <= batch.info["producer_idle_fraction"] <= 1.0
            if step:
                rates = batch.info["train_tokens_per_s"], batch.info["tokens_per_s"]
                assert rates[0] >= rates[1] > 0  # end to end includes any wait for the producer
            else:
                assert "train_tokens_per_s" not in batch.info
            assert_conserved(dm, batch)
            time.sleep(rng.uniform(0.0, 0.003))  # training
            if step >= warmup:  # critic warm-up steps publish nothing
                dm.publish([weights_of(dm.trainer_version + 1)], dm.trainer_version + 1)
            version_after.append(dm.trainer_version)
        assert dm.counters["trained"] == steps * 4 and dm.counters["dropped_stale"] == 0
    finally:
        dm.teardown("fit")
    if interruptible:
        assert mixed_rows > 0, "interruptible generation never mixed versions within a response"
    else:
        assert mixed_rows == 0


def test_rows_older_than_max_staleness_are_dropped_and_counted():
    # Resuming with a smaller bound: batches 1-3 were generated at version 0 (S = 3), batch 4 at 1;
    # the trainer is at version 3.
    dm = fake_module(FakeEngine, max_staleness=3, lag=3)
    dm.next_batch()
    for version in (1, 2, 3):
        dm.publish([weights_of(version)], version)
    state = dm.state_dict()
    dm.teardown("fit")
    resumed = fake_module(FakeEngine, max_staleness=1, lag=1, start=False)
    resumed.load_state_dict(state)
    resumed.start(FAKE_ACTOR)
    try:  # batches 1-4 lose every row and are skipped (counted); batch 5 is trained on
        batch = resumed.next_batch()
        assert len(batch) == 4 and batch.info["staleness_max"] == 0.0
        assert resumed.counters["dropped_stale"] == 4 * 4
        assert resumed.counters["empty_batches"] == 4
        assert_conserved(resumed, batch)
    finally:
        resumed.teardown("fit")


def test_resume_neither_loses_duplicates_nor_regenerates(tmp_path):
    calls: list[list[list[int]]] = []
    factory = partial(FakeEngine, calls=calls, max_delay=0.001)
    dm = fake_module(factory, max_staleness=2, interruptible=True)
    groups: list[int] = []

    def train(dm: AsyncRolloutDataModule, steps: int) -> None:
        for _ in range(steps):
            batch = dm.next_batch()
            groups.extend(batch.group_ids.tolist())
            assert_conserved(dm, batch)
            dm.publish([weights_of(dm.trainer_version + 1)], dm.trainer_version + 1)

    train(dm, 5)
    torch.save(dm.state_dict(), tmp_path / "state.pt")
    assert len(calls) == 5 + 2 + 1  # every admitted batch finished before the checkpoint
    dm.teardown("fit")
    resumed = fake_module(factory, max_staleness=2, interruptible=True, start=False)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert resumed.counters["buffered"] == 3 * 4
    resumed.start(FAKE_ACTOR)
    train(resumed, 5)
    resumed.state_dict()  # let the admitted batches finish
    resumed.teardown("fit")
    assert groups == [g for g in range(20) for _ in range(2)]  # every group once, in order
    assert len(calls) == 10 + 2 + 1  # nothing buffered was generated again
    assert resumed.counters["generated"] == 4 * len(calls)


def test_a_failing_producer_and_a_bad_publish_raise_clear_errors():
    dm = fake_module(partial(FakeEngine, fail_at_version=1), max_staleness=0)
    try:
        dm.next_batch()
        with pytest.raises(ValueError, match=r"publish got no tensor for 1 keys \(first 'bias'\)"):
            dm.publish([{"weight": torch.zeros(2, 2)}], 1)
        with pytest.raises(
            ValueError, match=r"publish got weight of shape \(3,\); expected \(2, 2\)"
        ):
            dm.publish([{"weight": torch.zeros(3), "bias": torch.zeros(2)}], 1)
        with pytest.raises(ValueError, match=r"publish got version=0; expected a version above"):
            dm.publish([weights_of(0)], 0)
        dm.publish([weights_of(1)], 1)
        with pytest.raises(
            RuntimeError,
            match=r"^the rollout producer failed while generating rollout batch 1 with version 1: "
            r"RuntimeError: fake engine exploded",
        ):
            dm.next_batch()
        assert dm._handle is None  # stopped
    finally:
        dm.teardown("fit")


def test_publish_fills_a_slot_bucket_by_bucket_and_a_bad_stream_keeps_it_free():
    dm = fake_module(FakeEngine, max_staleness=0)
    try:
        dm.next_batch()
        slots = dm._slots
        assert slots is not None
        free = len(slots._free)
        bad_streams = [
            ([{"weight": torch.zeros(2, 2)}], r"got no tensor for 1 keys \(first 'bias'\)"),
            ([{"weight": torch.zeros(3)}], r"got weight of shape \(3,\); expected \(2, 2\)"),
            ([weights_of(1), {"bias": torch.zeros(2)}], r"got 'bias' twice"),
        ]
        for stream, match in bad_streams:
            with pytest.raises(ValueError, match=rf"^publish {match}"):
                dm.publish(iter(stream), 1)
            assert len(slots._free) == free and dm.trainer_version == 0
        weights = weights_of(1)
        dm.publish(iter([{"weight": weights["weight"]}, {"bias": weights["bias"]}]), 1)
        assert dm.trainer_version == 1
        batch = dm.next_batch()  # sampled with the published version's weights
        assert (batch.behavior_logprobs[batch.mask] == 1.0).all()
        with pytest.raises(ValueError, match=r"^publish got version=1; expected a version above"):
            dm.publish(iter([weights_of(1)]), 1)
    finally:
        dm.teardown("fit")


class HooklessEngine(FakeEngine):
    """A FakeEngine whose ``generate`` takes no ``on_step`` hook (weights change between batches)."""

    def generate(self, prompts: list[list[int]], *, num_samples: int = 1) -> GenerationOutput:
        return super().generate(prompts, num_samples=num_samples)


def test_weight_slots_copy_into_reused_buffers_and_refuse_double_frees():
    with pytest.raises(ValueError, match=r"^WeightSlots needs count >= 1; got 0\.$"):
        WeightSlots(weights_of(1), 0, shared=False)
    source = weights_of(1)
    for shared in (False, True):
        slots = WeightSlots(source, 2, shared=shared)
        assert all(t.is_shared() == shared for slot in slots.tensors for t in slot.values())
        first = slots.fill(source)
        source["weight"].fill_(5.0)  # the slot holds a copy, not the trainer's tensor
        assert (slots.tensors[first]["weight"] == 1.0).all()
        second = slots.fill(source)
        assert {first, second} == {0, 1} and not slots.has_free
        slots.release(first)
        pointer = slots.tensors[first]["weight"].data_ptr()
        assert slots.fill(weights_of(7)) == first  # the same memory is refilled in place
        assert slots.tensors[first]["weight"].data_ptr() == pointer
        assert (slots.tensors[first]["weight"] == 7.0).all()
        slots.release(second)
        with pytest.raises(AssertionError, match="freed twice"):
            slots.release(second)
        source = weights_of(1)


# ---------------------------------------------------------------------------- both data modules


def test_the_sync_module_drops_stale_rows_through_split_stale(monkeypatch):
    calls: list[tuple[int, int, int | None, int, int]] = []

    def spy(batch, trainer_version, max_staleness):
        kept, report = split_stale(batch, trainer_version, max_staleness)
        calls.append((len(batch), trainer_version, max_staleness, report.dropped_stale, len(kept)))
        return kept, report

    monkeypatch.setattr(sync_data, "split_stale", spy)
    dm = RolloutDataModule(
        task=ArithmeticTask(),
        reward=ConstantReward(),
        prompts_per_step=2,
        samples_per_prompt=2,
        lag=1,
        max_staleness=1,
    )
    dm.engine = FakeEngine()
    dm._history[0] = weights_of(0)
    dm.publish([weights_of(1)], 1)  # lag 1: the engine keeps version 0, rows are 1 version old
    batch = dm.next_batch()
    assert len(batch) == 4 and batch.info["staleness_max"] == 1.0
    dm.max_staleness = 0  # as after a resume with a smaller bound: every row is too old
    assert len(dm._generate_batch()) == 0
    assert calls == [(4, 1, 1, 0, 4), (4, 1, 0, 4, 0)]
    c = dm.counters
    assert c["dropped_stale"] == 4 and c["trained"] == 4 and c["generated"] == 8


def test_a_data_module_without_connect_fails_with_one_sentence():
    modules = [
        RolloutDataModule(task=ArithmeticTask(), reward=ConstantReward()),
        fake_module(FakeEngine, start=False),
    ]
    for dm in modules:
        name = type(dm).__name__
        with pytest.raises(
            RuntimeError,
            match=rf"^{name} has no actor to build its engine from; expected connect\(handoff\) "
            r"first \(BraceModule.setup does it when this is the Trainer's datamodule\)\.$",
        ):
            dm.next_batch()
        dm.teardown("fit")


def _buckets(weights: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``weights`` cut into three buckets (the way an FSDP2 trainer streams them)."""
    names = list(weights)
    cuts = [names[:1], names[1:3], names[3:]]
    return [{name: weights[name].clone() for name in part} for part in cuts]


@pytest.mark.parametrize("lag", [0, 1])
def test_sync_publish_in_buckets_gives_the_engine_the_weights_of_one_dict(lag):
    actor = load_actor("tiny-char", tokenizer=load_tokenizer("tiny-char"), hidden_size=32)
    engines = {}
    for way in ("whole", "buckets"):
        dm = RolloutDataModule(task=ArithmeticTask(), reward=ConstantReward(), lag=lag)
        dm.connect(ActorHandoff(actor, bucket_bytes=None))
        dm._ensure_engine()
        for version in (1, 2):
            weights = {
                k: torch.randn_like(v, generator=torch.Generator().manual_seed(version))
                for k, v in actor.state_dict().items()
            }
            dm.publish([weights] if way == "whole" else _buckets(weights), version)
        engines[way] = dm.engine
    assert engines["whole"].version == engines["buckets"].version == 2 - lag
    whole, buckets = (engines[w].model.state_dict() for w in ("whole", "buckets"))
    assert all(torch.equal(whole[name], buckets[name]) for name in whole)
    assert not torch.equal(whole["model.norm.weight"], actor.state_dict()["model.norm.weight"])


class RecordingEngine(FakeEngine):
    """A FakeEngine that keeps a copy of every set of weights it installs."""

    def __init__(self, model: nn.Module, *, installed: list, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.installed = installed

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        super().update_weights(weights, version)
        self.installed.append((version, {k: v.clone() for k, v in weights.items()}))


def test_async_publish_in_buckets_gives_the_producer_the_weights_of_one_dict():
    published = {"weight": torch.arange(4.0).reshape(2, 2), "bias": torch.tensor([5.0, 6.0])}
    installed: dict[str, list] = {}
    for way in ("whole", "buckets"):
        installed[way] = []
        dm = fake_module(partial(RecordingEngine, installed=installed[way]), max_staleness=0)
        try:
            dm.next_batch()
            dm.publish([published] if way == "whole" else _buckets(published), 1)
            dm.next_batch()  # S = 0: generated with the version-1 weights
        finally:
            dm.teardown("fit")
    assert [v for v, _ in installed["whole"]] == [v for v, _ in installed["buckets"]]
    (version, whole), (_, buckets) = installed["whole"][-1], installed["buckets"][-1]
    assert version == 1 and all(torch.equal(whole[k], buckets[k]) for k in published)
    assert all(torch.equal(whole[k], published[k]) for k in published)


def test_publishing_faster_than_a_hookless_engine_waits_for_a_free_slot():
    # S = 4 in async mode uses 3 slots; an engine without decoding-step hooks frees them only
    # between batches, so six quick publishes must wait for the running batch to end.
    dm = fake_module(partial(HooklessEngine, length=30, max_delay=0.01), max_staleness=4)
    waits: list[str] = []
    wait = dm._wait
    dm._wait = lambda done, doing: (waits.append(doing), wait(done, doing))  # type: ignore[method-assign]
    try:
        dm.next_batch()
        for version in range(1, 7):
            dm.publish([weights_of(version)], version)
        assert dm._slots is not None and len(dm._slots.tensors) == 3
        assert any(doing.startswith("waiting for a free weight slot") for doing in waits)
        for _ in range(6):
            batch = dm.next_batch()
            actions = batch.versions[batch.mask]
            assert (batch.behavior_logprobs[batch.mask] == actions.float()).all()
            assert_conserved(dm, batch)
        assert int(batch.versions[batch.mask].max()) == 6  # the newest weights arrived
        assert batch.info["trainer_idle_fraction"] > 0  # the publishes that waited count as idle
    finally:
        dm.teardown("fit")


def test_on_step_hook_installs_weights_between_decoding_steps():
    tokenizer = load_tokenizer("tiny-char")
    actor = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=32, num_layers=1)
    engine = EmbeddedEngine(actor, max_new_tokens=6, stop_token_ids=[])
    calls = []

    def on_step() -> None:
        calls.append(engine.version)
        if len(calls) == 2:
            engine.update_weights(actor.state_dict(), 7)

    out = engine.generate([[1, 2, 3]], num_samples=2, on_step=on_step)
    assert out.versions == [[0, 0, 7, 7, 7, 7]] * 2 and len(calls) == 5
    plain = engine.generate([[1, 2, 3]], num_samples=2)
    assert plain.versions == [[7] * 6] * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_staleness": -1}, "max_staleness must be an integer >= 0; got -1."),
        (
            {"lag": 1},
            "lag must be None (newest weights before each batch) or max_staleness=2 (a fixed "
            "lag of exactly max_staleness versions); got 1.",
        ),
        ({"producer": "gpu"}, "producer must be 'process' or 'thread'; got 'gpu'."),
        ({"producer_timeout": 0}, "producer_timeout must be > 0 seconds; got 0."),
        ({"producer_threads": 0}, "producer_threads must be an integer >= 1; got 0."),
        ({"interruptible": True, "lag": 2}, "interruptible=True needs lag=None (newest weights)"),
        ({"interruptible": "yes"}, "interruptible must be a bool; got 'yes'."),
    ],
)
def test_bad_arguments_fail_with_one_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AsyncRolloutDataModule(task=ArithmeticTask(), reward=ConstantReward(), **kwargs)


def test_a_spawned_producer_never_receives_a_torch_module():
    # e.g. a factory closing over the LightningModule: refused before any process starts
    dm = AsyncRolloutDataModule(
        task=ArithmeticTask(), reward=ConstantReward(), engine=partial(FakeEngine, FAKE_ACTOR)
    )
    tokenizer = load_tokenizer("tiny-char")
    actor = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=32, num_layers=1)
    with pytest.raises(ValueError, match=r"cannot be pickled without the model \(it holds a torch"):
        dm.start(actor)
    assert dm.producer_pid is None


def test_cli_engine_factories_are_unwrapped_for_the_producer(tmp_path):
    from lightning.pytorch import LightningDataModule

    from brace_lightning.cli import BraceCLI
    from brace_lightning.module import BraceModule
    from brace_lightning.rollout.workers import portable_factory

    cli = BraceCLI(
        BraceModule,
        LightningDataModule,
        subclass_mode_data=True,
        run=False,
        args=small_run(tmp_path, "--config", str(CONFIGS / "async.yaml"))[1:],
    )
    factory = portable_factory(cli.datamodule.engine_factory)
    assert factory.func is EmbeddedEngine and factory.keywords["max_new_tokens"] == 12
    assert cli.datamodule.max_staleness == 2 and cli.datamodule.lag is None


# ---------------------------------------------------------------------------- real producers (slow)


class UpdateFailsAt(EmbeddedEngine):
    """An embedded engine whose weight update fails from version ``fail_at_version`` on."""

    def __init__(self, model: nn.Module, *, fail_at_version: int, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.fail_at_version = fail_at_version

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        if version >= self.fail_at_version:
            raise ValueError(
                f"update_weights got version {version}, which this test engine refuses"
            )
        super().update_weights(weights, version)


def tiny_module(**kwargs) -> tuple[AsyncRolloutDataModule, nn.Module]:
    tokenizer = load_tokenizer("tiny-char")
    actor = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=64, num_layers=1)
    options = dict(
        task=ArithmeticTask(),
        reward=ArithmeticReward(),
        engine=partial(EmbeddedEngine, max_new_tokens=8),
        prompts_per_step=2,
        samples_per_prompt=2,
    )
    options.update(kwargs)
    return AsyncRolloutDataModule(**options), actor


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: fall back to a signal probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return state in ("Z", "X")


@pytest.mark.slow
def test_producer_processes_fail_loudly_within_the_timeout():
    """Three producers started together: killed, hung (SIGSTOP) and a failing weight update."""
    killed, actor = tiny_module(max_staleness=0)
    hung, _ = tiny_module(max_staleness=0, producer_timeout=2.0)
    noisy, _ = tiny_module(
        max_staleness=1,
        interruptible=True,
        producer_threads=2,
        engine=partial(UpdateFailsAt, max_new_tokens=8, fail_at_version=7),
    )
    modules = (killed, hung, noisy)
    try:
        for dm in modules:
            dm.start(actor)
        rng = random.Random(0)
        # a real-process run under random trainer delays first: bound, conservation, mixed versions
        for step in range(6):
            batch = noisy.next_batch()
            assert int((noisy.trainer_version - batch.min_versions()).max()) <= 1
            assert_conserved(noisy, batch)
            time.sleep(rng.uniform(0.0, 0.05))
            noisy.publish([actor.state_dict()], step + 1)
        assert noisy.producer_info["torch_threads"] == 2
        for dm in (killed, hung):
            dm.next_batch()
            assert dm.producer_info["torch_threads"] == 1

        pid = killed.producer_pid
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            RuntimeError, match=rf"^the rollout producer \(pid {pid}\) exited with code -9"
        ):
            killed.publish([actor.state_dict()], 1)
            killed.next_batch()
        assert time.monotonic() - start < 5.0 and gone(pid)

        pid = hung.producer_pid
        os.kill(pid, signal.SIGSTOP)
        hung.publish([actor.state_dict()], 1)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"sent no heartbeat for .* producer_timeout=2 s"):
            hung.next_batch()
        assert 1.5 < time.monotonic() - start < 8.0
        assert gone(pid)  # the stopped process was killed, not left behind

        bad = {name: torch.zeros(3) for name in actor.state_dict()}
        with pytest.raises(ValueError, match=r"^publish got \S+ of shape \(3,\); expected \("):
            noisy.publish([bad], 7)  # refused in the trainer: the producer keeps running
        noisy.next_batch()
        noisy.publish(
            [actor.state_dict()], 7
        )  # the engine's update_weights fails from version 7 on
        with pytest.raises(
            RuntimeError,
            match=r"^the rollout producer failed while installing the weights of version 7: "
            r"ValueError: update_weights got",
        ):
            for _ in range(3):
                noisy.next_batch()
    finally:
        for dm in modules:
            dm.teardown("fit")


@pytest.mark.slow
def test_s0_equals_the_synchronous_path_bit_for_bit_and_teardown_ends_the_producer(tmp_path):
    steps = ["--data.max_staleness=0", "--trainer.limit_train_batches=3"]
    sync = run(small_run(tmp_path / "sync", "--data.lag=0", *steps, steps=3))
    cli = run(
        small_run(tmp_path / "async", "--config", str(CONFIGS / "async.yaml"), *steps, steps=3)
    )
    assert isinstance(cli.datamodule, AsyncRolloutDataModule)
    pid = cli.datamodule.producer_info["pid"]
    assert cli.datamodule.producer_pid is None and gone(pid)
    a, b = actor_weights(sync), actor_weights(cli)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    sa = read_scalars(sync.trainer.logger.log_dir)
    sb = read_scalars(cli.trainer.logger.log_dir)
    for name in ("rollout/reward", "actor/loss", "critic/loss", "weights/log_w_mean"):
        assert sa[name] == sb[name], name
    assert sb["data/staleness_max"] == [(1, 0.0), (2, 0.0), (3, 0.0)]
    counts = cli.datamodule.counters
    assert counts["trained"] == sync.datamodule.counters["trained"] == 3 * 8
    # the publish after the last step admitted one more batch: generated, buffered, not trained
    assert counts["generated"] == counts["trained"] + counts["buffered"] == 4 * 8


@pytest.mark.slow
def test_fixed_lag_resume_is_exact(tmp_path):
    common = [
        "--config",
        str(CONFIGS / "async.yaml"),
        "--data.lag=2",
        "--data.max_staleness=2",
        "--model.critic_warmup_steps=1",
        "--model.ppo_epochs=1",
        "--model.num_minibatches=2",
    ]
    straight = run(small_run(tmp_path / "straight", *common, steps=5))
    save = stop_and_checkpoint_at(tmp_path / "ckpt", 3)
    first = run(small_run(tmp_path / "first", *common, *save, steps=5))
    assert first.model.rollout_step == 3
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")  # named by rollout step
    state = torch.load(checkpoint, weights_only=True)["AsyncRolloutDataModule"]
    assert state["granted"] == 3 + 2 + 1 and len(state["buffer"]["batches"]) == 3
    resumed = run(small_run(tmp_path / "resumed", *common, f"--ckpt_path={checkpoint}", steps=5))
    assert resumed.model.rollout_step == 5
    a, b = actor_weights(straight), actor_weights(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    assert straight.datamodule.counters == resumed.datamodule.counters
    # behavior weights exactly S = 2 versions old once the trainer is two versions in
    staleness = read_scalars(straight.trainer.logger.log_dir)["data/staleness_mean"]
    versions = read_scalars(straight.trainer.logger.log_dir)["policy_version"]
    for (step, s), (_, v) in zip(staleness, versions, strict=True):
        before = v - (step > 1)  # the trainer's version when batch `step` was consumed
        assert s == min(2, before), step


class PrintProducerPid(pl.Callback):
    """Prints the producer's pid after the first step (for the Ctrl-C test's parent)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            print(f"PRODUCER_PID {trainer.datamodule.producer_pid}", flush=True)


@contextlib.contextmanager
def trainer_with_producer(args: list[str], **popen: Any) -> Iterator[tuple[subprocess.Popen, int]]:
    """A ``brace_lightning.cli.run(args)`` child process (stdout and stderr merged) and its
    producer's PID, printed by :class:`PrintProducerPid` after the first batch; both are killed
    on exit if still alive."""
    code = (
        "import faulthandler, signal, torch; torch.set_num_threads(1)\n"
        # Ctrl-C raises KeyboardInterrupt, as in a terminal's foreground job, even when the suite
        # itself was started in the background (``cmd &`` in a script): such a shell ignores
        # SIGINT for it, every child inherits that, and Python then installs no handler
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        # a hung child shows where its threads are (see ``stack_dump``)
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "from brace_lightning.cli import run\n"
        f"run({args!r})\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )
    pid = None
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("PRODUCER_PID"):
                pid = int(line.split()[1])
                break
        assert pid is not None, "".join(lines[-20:])
        yield process, pid
    finally:
        if process.poll() is None:
            process.kill()
        if pid is not None and not gone(pid):
            os.kill(pid, signal.SIGKILL)


def stack_dump(process: subprocess.Popen) -> str:
    """The last output of a hung :func:`trainer_with_producer` child, ending with the stacks of
    all its threads (faulthandler on SIGUSR1); the child is killed."""
    process.send_signal(signal.SIGUSR1)
    time.sleep(2.0)
    process.kill()
    rest, _ = process.communicate()
    return rest[-6000:]


@pytest.mark.slow
def test_ctrl_c_stops_the_producer_process(tmp_path):
    args = small_run(
        tmp_path,
        "--config",
        str(CONFIGS / "async.yaml"),
        "--trainer.callbacks+=tests.test_async.PrintProducerPid",
        steps=100000,
    )
    # its own process group, like a terminal's foreground job
    with trainer_with_producer(args, start_new_session=True) as (process, pid):
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches every process of the group
        try:
            rest, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the trainer did not exit within 60 s of Ctrl-C:\n{stack_dump(process)}")
        assert process.returncode == 1, rest[-2000:]
        assert "Detected KeyboardInterrupt" in rest
        deadline = time.monotonic() + 5
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pid), "the producer outlived the trainer"


@pytest.mark.slow
def test_sigterm_to_the_process_group_leaves_the_producer_to_the_trainer(tmp_path):
    # `scancel` and systemd send SIGTERM to every process of the job: a producer that died of it
    # first would fail the step the trainer is finishing and lose its checkpoint
    args = small_run(
        tmp_path,
        "--config",
        str(CONFIGS / "async.yaml"),
        "--trainer.callbacks+=tests.test_async.PrintProducerPid",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.callbacks.save_last=true",
        steps=100000,
    )
    with trainer_with_producer(args, start_new_session=True) as (process, pid):
        os.kill(pid, signal.SIGTERM)  # the producer alone first: it must not die of it
        time.sleep(1.5)
        assert not gone(pid), "the producer died of SIGTERM"
        os.killpg(process.pid, signal.SIGTERM)
        try:
            rest, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the trainer did not exit within 60 s of SIGTERM:\n{stack_dump(process)}")
        assert "rollout producer" not in rest, rest[-2000:]
        assert (tmp_path / "ckpt" / "last.ckpt").is_file(), rest[-2000:]
        deadline = time.monotonic() + 5
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pid), "the producer outlived the trainer"


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's",
)
def test_a_producer_process_keeps_an_8_mib_block_in_its_heap_instead_of_mmap():
    # in a fresh interpreter, as a producer process starts: glibc would map an 8 MiB block (and
    # unmap it on free) until keep_freed_memory() fixes its threshold at 32 MiB
    code = """
import ctypes, sys
from brace_lightning.rollout.workers import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "fixed":
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
block = ctypes.create_string_buffer(8 << 20)
print(libc.mallinfo2().hblkhd - before)
"""

    def mapped_bytes(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    assert mapped_bytes("default") >= 8 << 20
    assert mapped_bytes("fixed") == 0
