"""Faults and hostile input (issue 17): each test reproduces one failure that used to crash a run,
hang it, or pass silently, and checks the behavior that replaced it."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import lightning.pytorch as pl
import pytest
import torch

from brace_lightning.cli import run
from brace_lightning.data import AsyncRolloutDataModule, RolloutDataModule
from brace_lightning.logs import read_scalars
from brace_lightning.models.health import require_finite_weights
from brace_lightning.models.sources import load_actor, load_tokenizer
from brace_lightning.rollout import EmbeddedEngine, vllm_server
from brace_lightning.rollout.orphans import PARENT_PID_ENV
from brace_lightning.tasks import ArithmeticTask
from brace_lightning.tasks.base import Prompt, RewardFunction
from tests.test_async import (
    ROOT,
    FakeEngine,
    assert_conserved,
    fake_module,
    gone,
    trainer_with_producer,
)
from tests.test_trainer import CONFIGS, small_run, stop_and_checkpoint_at

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


# ---------------------------------------------------------------------------- diverged actor (17.3)

DIVERGE = ("--model.num_minibatches=1", "--model.ppo_epochs=1")


def test_a_diverged_actor_stops_at_the_sampler_with_a_sentence(tmp_path):
    """Actor lr 1e30: finite but huge weights whose logits are NaN; inverse-CDF sampling of the NaN
    distribution used to return index V (``index 100 is out of bounds``)."""
    args = small_run(tmp_path, "--model.actor_optimizer.init_args.lr=1e30", *DIVERGE, steps=3)
    with pytest.raises(FloatingPointError, match="^the embedded engine's next-token distribution"):
        run(args)


class OverflowActorGradients(pl.Callback):
    """Makes one actor gradient inf just before the actor's optimizer step (an overflowed backward
    after a finite loss): AdamW then writes NaN into the weights."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if optimizer is trainer.optimizers[0]:
            next(pl_module.actor.parameters()).grad.fill_(math.inf)


def test_non_finite_actor_weights_are_never_published(tmp_path):
    args = small_run(
        tmp_path, "--trainer.callbacks+=tests.test_faults.OverflowActorGradients", *DIVERGE, steps=3
    )
    with pytest.raises(
        FloatingPointError, match="^the actor's weights became non-finite at rollout step 0 "
    ):
        run(args)


def test_a_diverged_actor_in_an_async_run_fails_with_the_sentence(tmp_path):
    args = small_run(
        tmp_path,
        "--config",
        str(CONFIGS / "async.yaml"),
        "--data.producer=thread",
        "--model.actor_optimizer.init_args.lr=1e30",
        *DIVERGE,
        steps=4,
    )
    # Whichever meets the diverged weights first: the producer's sampler, or the trainer scoring a
    # batch sampled before the divergence.
    with pytest.raises((RuntimeError, FloatingPointError), match="diverged") as info:
        run(args)
    assert str(info.value).startswith(
        ("the actor's log-probs are not finite", "the rollout producer failed")
    ), info.value


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_embedded_sampler_refuses_non_finite_logits(temperature):
    actor = load_actor(
        "tiny-char", tokenizer=load_tokenizer("tiny-char"), hidden_size=32, num_layers=1
    )
    engine = EmbeddedEngine(actor, temperature=temperature)
    logits = torch.zeros(3, 10)
    logits[1, 4] = math.nan
    with pytest.raises(FloatingPointError, match=r"not finite in 1 of 3 rows at policy version 0"):
        engine._sample(logits)


def test_the_weight_check_names_the_tensor_and_raises_no_false_alarm():
    weights = {"a": torch.ones(3), "b": torch.full((4,), 3e38), "steps": torch.tensor([7])}
    assert require_finite_weights(weights, rollout_step=0) is None  # the sum overflows, not b
    weights["c"] = torch.tensor([1.0, math.inf])
    with pytest.raises(
        FloatingPointError,
        match=r"^the actor's weights became non-finite at rollout step 4 \(1 of 3 tensors, "
        r"first 'c'\)",
    ):
        require_finite_weights(weights, rollout_step=4)


# ---------------------------------------------------------------------------- bad options (17.7)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            ["--data.prompts_per_step=0"],
            "data.prompts_per_step: prompts_per_step must be an integer >= 1; got 0.",
        ),
        (
            ["--data.samples_per_prompt=-1"],
            "data.samples_per_prompt: samples_per_prompt must be an integer >= 1; got -1.",
        ),
        (
            ["--model.micro_batch_size=0"],
            "model.micro_batch_size: micro_batch_size must be None or an integer >= 1; got 0.",
        ),
        (
            ["--data.engine.init_args.max_new_tokens=0"],
            "data.engine.init_args.max_new_tokens: EmbeddedEngine got max_new_tokens=0; "
            "expected an integer >= 1.",
        ),
        (
            ["--data.engine.init_args.max_prompt_tokens=0"],
            "data.engine.init_args.max_prompt_tokens: EmbeddedEngine got max_prompt_tokens=0; "
            "expected None or an integer >= 1.",
        ),
        (
            ["--config", str(CONFIGS / "async.yaml"), "--data.max_staleness=-1"],
            "data.max_staleness: max_staleness must be an integer >= 0; got -1.",
        ),
        (
            ["--model.value_target.init_args.k", "-1"],
            "model.value_target.init_args.k: k must be an integer >= 0 or None (no cap); got -1.",
        ),
    ],
)
def test_construction_errors_look_like_parse_errors(tmp_path, capsys, options, expected):
    with pytest.raises(SystemExit) as info:
        run(small_run(tmp_path, *options))
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.strip().splitlines()[-1] == f"error: {expected}"
    assert "Traceback" not in err and "Namespace(" not in err


@pytest.mark.parametrize("flag", ["--config", "-c"])
def test_a_malformed_yaml_file_is_named(tmp_path, capsys, flag):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  ppo_epochs: [1\n")
    with pytest.raises(SystemExit) as info:
        run(small_run(tmp_path, flag, str(bad)))
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith(f"error: --config {bad}: not valid YAML at line 3, column 1")


# ---------------------------------------------------------------------------- long prompts (17.4)


def test_a_prompt_beyond_the_model_context_is_refused_or_cut_and_counted(tmp_path):
    """A 3,263-token prompt against max_position_embeddings = 1024 used to be accepted silently."""
    tokenizer = load_tokenizer("tiny-char")
    actor = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=32, num_layers=1)
    assert actor.config.max_position_embeddings == 1024
    long_prompt = [5] * 3263
    engine = EmbeddedEngine(actor, max_new_tokens=4)
    with pytest.raises(
        ValueError,
        match=r"^EmbeddedEngine got prompt 0 of 3263 tokens; expected at most max_prompt_tokens=1020 "
        r"\(the model's context is 1024\)",
    ):
        engine.generate([long_prompt])
    cutting = EmbeddedEngine(actor, max_new_tokens=4, max_prompt_tokens=6, truncation="left")
    out = cutting.generate([long_prompt[:-3] + [7, 8, 9], [5, 6]], num_samples=2)
    assert out.truncated_prompts == 2
    assert out.prompt_ids[0] == [5, 5, 5, 7, 8, 9] and out.prompt_ids[2] == [5, 6]
    with pytest.raises(ValueError, match="^EmbeddedEngine got truncation='right'; expected"):
        EmbeddedEngine(actor, truncation="right")
    with pytest.raises(ValueError, match="^EmbeddedEngine got max_prompt_tokens=0; expected"):
        EmbeddedEngine(actor, max_prompt_tokens=0)
    # In a run the count is a logged metric.
    cli = run(
        small_run(
            tmp_path,
            "--data.engine.init_args.max_prompt_tokens=3",
            "--data.engine.init_args.truncation=left",
            steps=1,
        )
    )
    logged = read_scalars(cli.trainer.logger.log_dir)["data/truncated_prompts"]
    assert logged == [(1, 8.0)]  # 4 prompts x 2 samples, each longer than 3 tokens


# ---------------------------------------------------------------------------- switched data module (17.5)

ONE_UPDATE = ("--model.ppo_epochs=1", "--model.num_minibatches=1")  # 2 optimizer steps per step
ASYNC = ("--config", str(CONFIGS / "async.yaml"), "--data.producer=thread")


@pytest.mark.parametrize(
    ("save_with", "resume_with", "saved", "current"),
    [
        ((), ASYNC, "RolloutDataModule", "AsyncRolloutDataModule"),
        (ASYNC, (), "AsyncRolloutDataModule", "RolloutDataModule"),
    ],
    ids=["sync-to-async", "async-to-sync"],
)
def test_resuming_with_the_other_data_module_is_refused(
    tmp_path, save_with, resume_with, saved, current
):
    """Sync checkpoint + async module used to restart at version 0 and die 4 versions stale; async
    checkpoint + sync module neither trained nor counted the buffered samples."""
    save = stop_and_checkpoint_at(tmp_path / "ckpt", 5)
    first = run(small_run(tmp_path / "first", *save_with, *ONE_UPDATE, *save, steps=5))
    assert first.model.rollout_step == 5
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")  # named by rollout step
    assert torch.load(checkpoint, weights_only=True)["brace"]["data_module"] == saved
    resume = small_run(tmp_path / "resumed", *resume_with, *ONE_UPDATE, steps=7)
    with pytest.raises(
        ValueError,
        match=rf"^the checkpoint was written with the data module {saved} but this run uses "
        rf"{current}; expected the same data module",
    ):
        run([*resume, f"--ckpt_path={checkpoint}"])
    # The same data module loads it (the checkpoint ends the one epoch: nothing more to train).
    same = small_run(tmp_path / "same", *save_with, *ONE_UPDATE, steps=5)
    resumed = run([*same, f"--ckpt_path={checkpoint}"])
    assert resumed.model.rollout_step == 5
    assert resumed.datamodule.counters == first.datamodule.counters


# ---------------------------------------------------------------------------- orphans (17.6)


class HangingEngine(EmbeddedEngine):
    """Generates the first batch, then hangs in its second ``generate`` call (a stuck engine)."""

    calls = 0

    def generate(self, *args, **kwargs):
        HangingEngine.calls += 1
        if HangingEngine.calls >= 2:
            time.sleep(3600)
        return super().generate(*args, **kwargs)


def wait_gone(pids: list[int], seconds: float) -> float:
    start = time.monotonic()
    while not all(gone(p) for p in pids) and time.monotonic() - start < seconds:
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and SIGKILL")
def test_a_hung_producer_dies_within_5_s_of_a_sigkilled_trainer(tmp_path):
    """The producer used to check for its parent only at heartbeats: 19.4 s after the kill during a
    20 s decoding step, forever in a hung engine call."""
    args = small_run(
        tmp_path,
        "--config",
        str(CONFIGS / "async.yaml"),
        "--data.engine.class_path=tests.test_faults.HangingEngine",
        "--trainer.callbacks+=tests.test_async.PrintProducerPid",
        steps=100,
    )
    with trainer_with_producer(args) as (trainer, pid):
        time.sleep(1.0)  # the producer is now inside its hung second generate call
        assert not gone(pid)
        trainer.kill()  # SIGKILL: no teardown, no exception handler runs in the trainer
        trainer.wait(timeout=10)
        seconds = wait_gone([pid], 10.0)
        assert gone(pid) and seconds < 5.0, f"the producer outlived the trainer by {seconds:.1f} s"


LAUNCHER = """
import os, subprocess, sys
child = '''
import os, subprocess, sys, time
from brace_lightning.rollout.orphans import PARENT_PID_ENV, die_with_parent
die_with_parent(int(os.environ.pop(PARENT_PID_ENV)), kill_group=True)
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(os.getpid(), engine.pid, flush=True)
time.sleep(600)
'''
env = dict(os.environ, BRACE_PARENT_PID=str(os.getpid()))
server = subprocess.Popen([sys.executable, "-c", child], env=env, start_new_session=True)
server.wait()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and SIGKILL")
def test_a_launched_server_group_ends_with_its_client():
    """What ``VLLMServer`` does: the server runs in its own process group (so its engine processes
    can be ended together) and that group ends within 5 s of the client's death."""
    client = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        pids = [int(p) for p in client.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        client.kill()
        client.wait(timeout=10)
        seconds = wait_gone(pids, 10.0)
        assert all(gone(p) for p in pids) and seconds < 5.0, f"outlived by {seconds:.1f} s"
    finally:
        if client.poll() is None:
            client.kill()
        for pid in pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_vllm_server_hands_the_launcher_its_pid(tmp_path, monkeypatch):
    """``VLLMServer`` starts the launcher of the test above: own session, this process's pid."""
    started = {}
    popen = subprocess.Popen

    def fake_popen(command, **kwargs):
        started.update(kwargs, command=command)
        return popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(vllm_server.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(vllm_server.VLLMServer, "_wait_ready", lambda self, timeout: None)
    vllm_server.VLLMServer(tmp_path, port=1, log_path=tmp_path / "log")
    assert started["command"][1:3] == ["-m", "brace_lightning.rollout.vllm_server"]
    assert started["start_new_session"] is True
    assert started["env"][PARENT_PID_ENV] == str(os.getpid())


def test_every_test_the_reliability_doc_names_exists():
    text = (ROOT / "docs" / "reliability.md").read_text()
    named = set(re.findall(r"(tests/\w+\.py)::(\w+)", text))
    bare = set(re.findall(r"`(test_\w+)`", text))
    assert len(named) > 20 and bare
    sources = {p.name: p.read_text() for p in (ROOT / "tests").glob("test_*.py")}
    for path, test in named:
        assert f"def {test}(" in (ROOT / path).read_text(), f"{path}::{test}"
    for test in bare:
        assert any(f"def {test}(" in source for source in sources.values()), test
