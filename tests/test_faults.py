"""Faults and hostile input (issue 17): each test reproduces one failure that used to crash a run,
hang it, or pass silently, and checks the behavior that replaced it."""

from __future__ import annotations

import math

import pytest

from brace_lightning.data import AsyncRolloutDataModule, RolloutDataModule
from brace_lightning.tasks import ArithmeticTask
from brace_lightning.tasks.base import Prompt, RewardFunction
from tests.test_async import FakeEngine, assert_conserved, fake_module

# ---------------------------------------------------------------------------- empty batches (17.2)


class DownThenUpReward(RewardFunction):
    """A verifier that is down (returns NaN) for its first ``down`` calls, then scores 1."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.calls = 0

    def __call__(self, prompt: Prompt, completion: str) -> float:
        self.calls += 1
        return math.nan if self.calls <= self.down else 1.0


def sync_module(**kwargs) -> RolloutDataModule:
    options = dict(task=ArithmeticTask(), prompts_per_step=1, samples_per_prompt=1)
    options.update(kwargs)
    dm = RolloutDataModule(**options)
    dm.engine = FakeEngine()
    return dm


def async_module(**kwargs) -> AsyncRolloutDataModule:
    return fake_module(FakeEngine, prompts_per_step=1, samples_per_prompt=1, **kwargs)


@pytest.mark.parametrize("build", [sync_module, async_module], ids=["sync", "async"])
def test_batches_whose_samples_were_all_dropped_are_skipped_and_counted(build):
    """1 prompt x 1 sample and a verifier down for two calls: the async module used to raise
    ``IndexError: amax(): Expected reduction dim 1 to have non-zero size`` at step 0."""
    dm = build(reward=DownThenUpReward(down=2), max_staleness=0)
    try:
        batch = dm.next_batch()
        assert len(batch) == 1 and batch.num_actions > 0
        assert dm.counters["empty_batches"] == 2 and dm.counters["dropped_reward_error"] == 2
        assert dm.counters["generated"] == 3 and dm.counters["trained"] == 1
        assert batch.info["count/empty_batches"] == 2.0
        if isinstance(dm, AsyncRolloutDataModule):
            assert_conserved(dm, batch)
    finally:
        dm.teardown("fit")


@pytest.mark.parametrize("build", [sync_module, async_module], ids=["sync", "async"])
def test_a_verifier_that_stays_down_stops_the_run_with_one_sentence(build):
    dm = build(
        reward=DownThenUpReward(down=10**6), max_staleness=0, max_consecutive_empty_batches=3
    )
    try:
        with pytest.raises(
            RuntimeError, match=r"^3 rollout batches in a row had no sample"
        ) as info:
            dm.next_batch()
        assert "dropped_reward_error=3" in str(info.value)
        assert "max_consecutive_empty_batches=3" in str(info.value)
        assert dm.counters["empty_batches"] == 3
    finally:
        dm.teardown("fit")


@pytest.mark.parametrize("build", [sync_module, async_module], ids=["sync", "async"])
def test_max_consecutive_empty_batches_is_checked(build):
    with pytest.raises(ValueError, match="^max_consecutive_empty_batches must be an integer >= 1"):
        build(reward=DownThenUpReward(0), max_consecutive_empty_batches=0)
