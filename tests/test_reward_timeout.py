"""A reward that hangs cannot hang the run (``reward_timeout``, issue 34 item 4).

The hanging rewards here wait on an event that each test sets when it ends, so the abandoned
threads finish and do not count against the next test's bound on abandoned calls.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from brace_lightning.data import AsyncRolloutDataModule, RolloutDataModule
from brace_lightning.models import load_tokenizer
from brace_lightning.rollout import reward_timeout as timeouts
from brace_lightning.rollout.collect import score_and_pad
from brace_lightning.rollout.engine import GenerationOutput
from brace_lightning.rollout.reward_timeout import RewardDeadline, check_reward_timeout
from brace_lightning.tasks import ArithmeticTask
from brace_lightning.tasks.base import Prompt, RewardFunction
from tests.test_async import ConstantReward, FakeEngine, assert_conserved, fake_module

TOKENIZER = load_tokenizer("tiny-char")
TIMEOUT = 0.5


class HangingReward(RewardFunction):
    """Scores ``len(completion)``; hangs (until ``release`` is set) on the calls numbered in
    ``hang_on`` (0-based, counting ``__call__`` only), or on every call when ``hang_on`` is None."""

    def __init__(self, release: threading.Event, hang_on: set[int] | None) -> None:
        self.release = release
        self.hang_on = hang_on
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, prompt: Prompt, completion: str) -> float:
        with self.lock:
            number, self.calls = self.calls, self.calls + 1
        if self.hang_on is None or number in self.hang_on:
            self.release.wait()
        return float(len(completion))

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        return True  # not through __call__, so calls count samples


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at the end of the test: every hung reward call returns and its thread ends."""
    event = threading.Event()
    yield event
    event.set()
    deadline = time.monotonic() + 5.0
    while timeouts.abandoned_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert timeouts.abandoned_threads() == 0


def generated(n: int) -> GenerationOutput:
    """``n`` samples of one prompt; sample i answers ``i + 1`` characters."""
    ids = TOKENIZER("1", add_special_tokens=False)["input_ids"]
    return GenerationOutput(
        prompt_ids=[list(ids) for _ in range(n)],
        response_ids=[ids * (i + 1) for i in range(n)],
        logprobs=[[0.0] * (i + 1) for i in range(n)],
        versions=[[0] * (i + 1) for i in range(n)],
        prompt_index=[0] * n,
        finish_reason=["stop"] * n,
    )


def score(reward: RewardFunction, n: int, timeout: float | None, **kwargs):
    prompts = [Prompt(text="q", answer="1")]
    return score_and_pad(
        generated(n), prompts, TOKENIZER, reward, 0, 0, reward_timeout=timeout, **kwargs
    )


def test_a_reward_that_hangs_on_one_sample_drops_only_that_sample(release):
    reward = HangingReward(release, hang_on={1})
    start = time.monotonic()
    batch = score(reward, 4, TIMEOUT)
    elapsed = time.monotonic() - start
    assert TIMEOUT <= elapsed < TIMEOUT + 2.0
    assert batch.scores.tolist() == [1.0, 3.0, 4.0]  # sample 1 (2 characters) is gone
    assert batch.info["generated"] == 4.0
    assert batch.info["dropped_reward_error"] == 1.0
    assert batch.info["reward_timeouts"] == 1.0
    assert timeouts.abandoned_threads() == 1


def test_without_a_timeout_the_batch_is_the_same_and_has_no_timeout_count(release):
    inline = score(HangingReward(release, hang_on=set()), 3, None)
    timed = score(HangingReward(release, hang_on=set()), 3, TIMEOUT)
    assert "reward_timeouts" not in inline.info and timed.info["reward_timeouts"] == 0.0
    for name in ("input_ids", "mask", "rewards", "scores", "correct", "group_ids"):
        assert getattr(inline, name).equal(getattr(timed, name)), name


def test_a_reward_error_under_a_timeout_is_a_reward_error_not_a_timeout(release):
    class Raising(RewardFunction):
        def __call__(self, prompt: Prompt, completion: str) -> float:
            if len(completion) == 2:
                raise TimeoutError("the reward's own server timed out")
            return 1.0

    batch = score(Raising(), 3, TIMEOUT)
    assert batch.info["dropped_reward_error"] == 1.0 and batch.info["reward_timeouts"] == 0.0
    assert len(batch) == 2


def test_every_sample_hanging_stops_with_one_sentence(release):
    with pytest.raises(
        RuntimeError,
        match=r"^every one of the 2 samples of a rollout batch timed out in the reward "
        r"HangingReward \(reward_timeout=0\.5 s\); check that the verifier returns \(a server it "
        r"needs may be down\), or raise reward_timeout if it is only slow\.$",
    ):
        score(HangingReward(release, hang_on=None), 2, TIMEOUT)


def test_abandoned_calls_are_bounded(release, monkeypatch):
    monkeypatch.setattr(timeouts, "MAX_ABANDONED", 2)
    reward = HangingReward(release, hang_on={0, 3})
    batch = score(reward, 3, 0.2)  # call 0 is abandoned, calls 1 and 2 return
    assert batch.info["reward_timeouts"] == 1.0 and timeouts.abandoned_threads() == 1
    with pytest.raises(
        RuntimeError,
        match=r"^2 calls of the reward HangingReward are still running after reward_timeout=0\.2 "
        r"s ran out and Python cannot stop a thread, so the run stops instead of starting more; "
        r"make the reward return \(give it its own time limit\) or raise reward_timeout\.$",
    ):
        score(reward, 3, 0.2)  # call 3 is abandoned: no thread may start for call 4
    assert reward.calls == 4


def test_the_heartbeat_beats_while_a_call_is_awaited(release):
    beats: list[float] = []
    with RewardDeadline(0.6, "HangingReward", heartbeat=lambda: beats.append(1.0)) as deadline:
        with pytest.raises(timeouts.RewardTimeout, match="did not return within"):
            deadline.call(HangingReward(release, hang_on=None), Prompt(text="q", answer="1"), "a")
    assert len(beats) >= 3  # every BEAT_SECONDS = 0.2 s


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "5"])
def test_a_bad_reward_timeout_is_one_sentence(value):
    message = (
        r"^reward_timeout must be None \(no timeout\) or a finite number of seconds > 0; got "
        + repr(value).replace("(", r"\(").replace(")", r"\)")
        + r"\.$"
    )
    with pytest.raises(ValueError, match=message):
        check_reward_timeout(value)
    with pytest.raises(ValueError, match=message):
        RolloutDataModule(task=ArithmeticTask(), reward=ConstantReward(), reward_timeout=value)
    with pytest.raises(ValueError, match=message):
        AsyncRolloutDataModule(task=ArithmeticTask(), reward=ConstantReward(), reward_timeout=value)
    assert check_reward_timeout(None) is None and check_reward_timeout(2) == 2.0


def test_the_sync_module_drops_a_hung_sample_and_conserves_counts(release):
    reward = HangingReward(release, hang_on={2})
    dm = RolloutDataModule(
        task=ArithmeticTask(),
        reward=reward,
        prompts_per_step=2,
        samples_per_prompt=2,
        reward_timeout=TIMEOUT,
    )
    dm.engine = FakeEngine()
    start = time.monotonic()
    batch = dm.next_batch()
    assert time.monotonic() - start < TIMEOUT + 3.0
    assert len(batch) == 3
    c = dm.counters
    assert c["generated"] == 4 and c["trained"] == 3 and c["dropped_reward_error"] == 1
    # The hung sample's group keeps its other row: one partial group, counted (issue 32).
    assert sorted(batch.group_ids.bincount().tolist()) == [1, 2]
    assert batch.info["partial_groups"] == 1.0
    assert "partial_groups" not in dm.next_batch().info  # whole groups: nothing to count


def test_the_async_module_drops_a_hung_sample_and_conserves_counts(release):
    reward = HangingReward(release, hang_on={1})
    dm = fake_module(FakeEngine, reward=reward, reward_timeout=TIMEOUT, producer_timeout=0.4)
    try:  # the producer beats while it waits on the reward: no heartbeat timeout at 0.4 s
        batch = dm.next_batch()
        assert len(batch) == 3 and dm.counters["dropped_reward_error"] == 1
        assert batch.info["reward_timeouts"] == 1.0
        assert batch.info["partial_groups"] == 1.0  # the hung sample's group lost one row
        assert_conserved(dm, batch)
    finally:
        dm.teardown("fit")
