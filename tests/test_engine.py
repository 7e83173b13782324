"""The embedded rollout engine and ``collect_rollouts``."""

from __future__ import annotations

import re
from collections.abc import Mapping

import pytest
import torch

from brace_lightning.models.policy import load_causal_lm, tiny_qwen2_config, token_logprobs
from brace_lightning.models.tokenizer import build_char_tokenizer
from brace_lightning.rollout.collect import collect_rollouts
from brace_lightning.rollout.embedded import EmbeddedEngine
from brace_lightning.rollout.engine import GenerationOutput, RolloutEngine
from brace_lightning.tasks.arithmetic import ArithmeticReward
from brace_lightning.tasks.base import Prompt, RewardFunction

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20]]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def config(tokenizer):
    # Untied and with a larger init than the default: a random tied model's greedy decoding just
    # repeats the last token, which would make greedy comparisons vacuous.
    config = tiny_qwen2_config(
        len(tokenizer),
        hidden_size=64,
        num_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config.initializer_range = 0.1
    return config


@pytest.fixture(scope="module")
def actor(config):
    return load_causal_lm(config, seed=0)


def _padded(out: GenerationOutput) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts + right-padded responses, like a RolloutBatch; returns ids, mask, P."""
    p = max(len(x) for x in out.prompt_ids)
    r = max(len(x) for x in out.response_ids)
    ids = torch.zeros(len(out), p + r, dtype=torch.long)
    mask = torch.zeros(len(out), p + r, dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(out.prompt_ids, out.response_ids, strict=True)):
        ids[i, p - len(prompt) : p + len(response)] = torch.tensor(prompt + response)
        mask[i, p - len(prompt) : p + len(response)] = True
    return ids, mask, p


def test_seeded_determinism(actor):
    a = EmbeddedEngine(actor, max_new_tokens=12, seed=3).generate(PROMPTS, num_samples=2)
    b = EmbeddedEngine(actor, max_new_tokens=12, seed=3).generate(PROMPTS, num_samples=2)
    c = EmbeddedEngine(actor, max_new_tokens=12, seed=4).generate(PROMPTS, num_samples=2)
    assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
    assert a.response_ids != c.response_ids


def test_offset_seed_gives_each_rank_its_own_stream(actor):
    rank0 = EmbeddedEngine(actor, max_new_tokens=12, seed=3).generate(PROMPTS, num_samples=2)
    shifted = EmbeddedEngine(actor, max_new_tokens=12, seed=3)
    shifted.generate(PROMPTS)  # the offset restarts the stream, whatever was drawn before
    shifted.offset_seed(1)
    seed4 = EmbeddedEngine(actor, max_new_tokens=12, seed=4).generate(PROMPTS, num_samples=2)
    out = shifted.generate(PROMPTS, num_samples=2)
    assert out.response_ids == seed4.response_ids and out.response_ids != rank0.response_ids


def test_producer_engines_are_offset_by_the_rank(actor):
    from brace_lightning.rollout.workers import ProducerSpec, build_engine

    def spec(offset: int) -> ProducerSpec:
        return ProducerSpec(
            engine_factory=lambda model: EmbeddedEngine(model, max_new_tokens=12, seed=3),
            tokenizer="tiny-char",
            reward=ArithmeticReward(),
            samples_per_prompt=2,
            exact_versions=False,
            interruptible=False,
            seed_offset=offset,
        )

    rank0 = build_engine(spec(0), actor).generate(PROMPTS, num_samples=2)
    rank1 = build_engine(spec(1), actor).generate(PROMPTS, num_samples=2)
    seed4 = EmbeddedEngine(actor, max_new_tokens=12, seed=4).generate(PROMPTS, num_samples=2)
    assert rank1.response_ids == seed4.response_ids != rank0.response_ids


def test_state_dict_resumes_the_sampling_stream(actor):
    engine = EmbeddedEngine(actor, max_new_tokens=6, seed=3)
    engine.generate(PROMPTS)
    state = engine.state_dict()
    expected = engine.generate(PROMPTS)
    resumed = EmbeddedEngine(actor, max_new_tokens=6, seed=99)
    resumed.load_state_dict(state)
    assert resumed.generate(PROMPTS).response_ids == expected.response_ids


def test_output_order_and_per_token_lengths(actor):
    out = EmbeddedEngine(actor, max_new_tokens=8).generate(PROMPTS, num_samples=3)
    assert len(out) == 9
    assert out.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert out.prompt_ids == [p for p in PROMPTS for _ in range(3)]
    for i in range(len(out)):
        n = len(out.response_ids[i])
        assert 1 <= n <= 8
        assert len(out.logprobs[i]) == len(out.versions[i]) == len(out.entropy[i]) == n


def test_stop_tokens_end_responses_and_are_included(actor):
    stop = list(range(3, 60))  # most of the vocabulary: rows stop within a few tokens
    out = EmbeddedEngine(actor, max_new_tokens=30, stop_token_ids=stop).generate(
        PROMPTS, num_samples=4
    )
    for response, reason in zip(out.response_ids, out.finish_reason, strict=True):
        if reason == "stop":
            assert response[-1] in stop
            assert all(t not in stop for t in response[:-1])
        else:
            assert len(response) == 30 and all(t not in stop for t in response)
    assert out.finish_reason.count("stop") > 0


def test_max_new_tokens_without_stop(actor):
    out = EmbeddedEngine(actor, max_new_tokens=5, stop_token_ids=[]).generate(PROMPTS)
    assert [len(r) for r in out.response_ids] == [5, 5, 5]
    assert out.finish_reason == ["length"] * 3


def test_default_stop_is_eos(actor):
    engine = EmbeddedEngine(actor)
    assert engine.stop_token_ids == [actor.config.eos_token_id]


def test_left_padded_batch_matches_one_prompt_at_a_time(actor):
    engine = EmbeddedEngine(actor, temperature=0.0, max_new_tokens=10, stop_token_ids=[])
    batched = engine.generate(PROMPTS)
    assert (
        len({tuple(r) for r in batched.response_ids}) == 3 and len(set(batched.response_ids[0])) > 1
    )
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt])
        assert alone.response_ids[0] == batched.response_ids[i]
    # Sampled tokens: the recorded log-probs of a padded batch equal each sample's log-probs
    # computed alone, without padding.
    out = EmbeddedEngine(actor, max_new_tokens=10, seed=5).generate(PROMPTS, num_samples=2)
    for i in range(len(out)):
        ids = torch.tensor([out.prompt_ids[i] + out.response_ids[i]])
        with torch.no_grad():
            alone_logprobs, _ = token_logprobs(actor, ids, torch.ones_like(ids, dtype=torch.bool))
        n = len(out.response_ids[i])
        assert (alone_logprobs[0, -n:] - torch.tensor(out.logprobs[i])).abs().max() < 1e-4
    chunked = EmbeddedEngine(
        actor, temperature=0.0, max_new_tokens=10, stop_token_ids=[], max_batch_size=2
    ).generate(PROMPTS)
    assert chunked.response_ids == batched.response_ids


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_behavior_logprobs_equal_recomputed_logprobs(actor, temperature):
    engine = EmbeddedEngine(actor, temperature=temperature, max_new_tokens=12, seed=1)
    out = engine.generate(PROMPTS, num_samples=2)
    ids, mask, p = _padded(out)
    with torch.no_grad():
        logprobs, entropy = token_logprobs(
            actor, ids, mask, temperature=temperature, return_entropy=True
        )
    for i, response in enumerate(out.response_ids):
        n = len(response)
        recorded = torch.tensor(out.logprobs[i])
        assert (recorded - logprobs[i, p : p + n]).abs().max() < 1e-4
        assert (torch.tensor(out.entropy[i]) - entropy[i, p : p + n]).abs().max() < 1e-4


def test_top_p_records_the_truncated_distribution(actor):
    full = EmbeddedEngine(actor, max_new_tokens=10, seed=1, stop_token_ids=[])
    nucleus = EmbeddedEngine(actor, max_new_tokens=10, seed=1, stop_token_ids=[], top_p=0.5)
    out = nucleus.generate(PROMPTS, num_samples=2)
    ids, mask, p = _padded(out)
    with torch.no_grad():
        untruncated, untruncated_entropy = token_logprobs(actor, ids, mask, return_entropy=True)
    for i in range(len(out)):
        recorded = torch.tensor(out.logprobs[i])
        assert (recorded >= untruncated[i, p:] - 1e-5).all()
        assert (torch.tensor(out.entropy[i]) < untruncated_entropy[i, p:]).all()
    assert out.response_ids != full.generate(PROMPTS, num_samples=2).response_ids
    # A nucleus that keeps only the top token is greedy decoding with log µ = 0.
    tiny = EmbeddedEngine(actor, max_new_tokens=6, stop_token_ids=[], top_p=1e-6).generate(PROMPTS)
    greedy = EmbeddedEngine(actor, temperature=0.0, max_new_tokens=6, stop_token_ids=[]).generate(
        PROMPTS
    )
    assert tiny.response_ids == greedy.response_ids
    assert all(lp == 0.0 for row in tiny.logprobs for lp in row)


def test_temperature_changes_sampling_entropy(actor):
    cold = EmbeddedEngine(actor, temperature=0.3, max_new_tokens=6).generate(PROMPTS)
    hot = EmbeddedEngine(actor, temperature=1.5, max_new_tokens=6).generate(PROMPTS)
    assert hot.entropy[0][0] > cold.entropy[0][0]


def test_versions_and_update_weights(actor, config):
    engine = EmbeddedEngine(actor, temperature=0.0, max_new_tokens=8, stop_token_ids=[])
    before = engine.generate(PROMPTS)
    assert engine.version == 0 and all(v == 0 for row in before.versions for v in row)
    other = load_causal_lm(config, seed=7)
    engine.update_weights(other.state_dict(), version=3)
    after = engine.generate(PROMPTS)
    assert engine.version == 3 and all(v == 3 for row in after.versions for v in row)
    assert after.response_ids != before.response_ids
    reference = EmbeddedEngine(other, temperature=0.0, max_new_tokens=8, stop_token_ids=[])
    assert after.response_ids == reference.generate(PROMPTS).response_ids
    # Sampled log-probs after the update are the new weights' log-probs.
    sampled = EmbeddedEngine(actor, max_new_tokens=8, seed=2)
    sampled.update_weights(other.state_dict(), version=4)
    assert sampled.generate(PROMPTS).logprobs == (
        EmbeddedEngine(other, max_new_tokens=8, seed=2).generate(PROMPTS).logprobs
    )


def test_engine_holds_its_own_copy(actor, config):
    model = load_causal_lm(config, seed=0)
    engine = EmbeddedEngine(model, temperature=0.0, max_new_tokens=8, stop_token_ids=[])
    before = engine.generate(PROMPTS).response_ids
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    assert engine.generate(PROMPTS).response_ids == before
    assert all(not p.requires_grad for p in engine.model.parameters())


def test_update_weights_rejects_bad_state_dicts(actor):
    engine = EmbeddedEngine(actor)
    weights = dict(actor.state_dict())
    missing = dict(weights)
    del missing["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing keys \['lm_head.weight'\]"):
        engine.update_weights(missing, version=1)
    with pytest.raises(ValueError, match=r"unexpected keys \['extra.weight'\]"):
        engine.update_weights({**weights, "extra.weight": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="lm_head.weight of shape"):
        engine.update_weights({**weights, "lm_head.weight": torch.zeros(3, 3)}, version=1)
    with pytest.raises(ValueError, match="version=-1"):
        engine.update_weights(weights, version=-1)
    assert engine.version == 0


def test_update_weights_from_buckets_installs_a_stream_and_rejects_bad_ones(actor, config):
    other = load_causal_lm(config, seed=7)
    weights = other.state_dict()
    names = list(weights)
    buckets = [{n: weights[n] for n in names[i : i + 3]} for i in range(0, len(names), 3)]
    engine = EmbeddedEngine(actor, temperature=0.0, max_new_tokens=8, stop_token_ids=[])
    engine.update_weights_from_buckets(iter(buckets), version=2)
    assert engine.version == 2
    assert all(torch.equal(engine.model.state_dict()[n], weights[n]) for n in names)
    whole = EmbeddedEngine(actor, temperature=0.0, max_new_tokens=8, stop_token_ids=[])
    whole.update_weights(weights, version=2)
    assert engine.generate(PROMPTS).response_ids == whole.generate(PROMPTS).response_ids
    bad_streams = [
        (buckets[:-1], r"got no tensor for \d+ keys \(first '"),
        ([*buckets, buckets[0]], r"got '[\w.]+' twice; expected each key"),
        ([{"extra.weight": torch.zeros(1)}], r"got 'extra.weight' which is not a key of the actor"),
        ([{names[0]: torch.zeros(3, 3)}], rf"got {re.escape(names[0])} of shape \(3, 3\)"),
    ]
    for stream, match in bad_streams:
        with pytest.raises(ValueError, match=rf"^update_weights_from_buckets {match}"):
            engine.update_weights_from_buckets(iter(stream), version=3)
    with pytest.raises(ValueError, match=r"^update_weights_from_buckets got version=-1; expected"):
        engine.update_weights_from_buckets(iter(buckets), version=-1)
    assert engine.version == 2  # a failed stream does not change the version


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_batch_size": 0}, "max_batch_size=0"),
    ],
)
def test_engine_argument_validation(actor, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EmbeddedEngine(actor, **kwargs)


def test_generate_input_validation(actor):
    engine = EmbeddedEngine(actor, max_new_tokens=2)
    with pytest.raises(ValueError, match="empty prompts\\[1\\]"):
        engine.generate([[5], []])
    with pytest.raises(ValueError, match="token id 1000 in prompts\\[0\\]"):
        engine.generate([[1000]])
    with pytest.raises(ValueError, match="num_samples=0"):
        engine.generate([[5]], num_samples=0)


def test_generation_output_validation():
    with pytest.raises(ValueError, match=r"logprobs\[0\] has 1 values; expected 2"):
        GenerationOutput([[1]], [[2, 3]], [[0.0]], [[0, 0]], [0], ["stop"])


# ---------------------------------------------------------------- collect_rollouts


class ScriptedEngine(RolloutEngine):
    """Returns fixed responses so that the batch layout can be checked exactly."""

    def __init__(self, responses: list[list[int]], version: int = 2) -> None:
        self.responses = responses
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self._version = version

    def generate(self, prompts: list[list[int]], *, num_samples: int = 1) -> GenerationOutput:
        n = len(prompts) * num_samples
        responses = self.responses[:n]
        return GenerationOutput(
            prompt_ids=[p for p in prompts for _ in range(num_samples)],
            response_ids=responses,
            logprobs=[[-0.5 - 0.1 * j for j in range(len(r))] for r in responses],
            versions=[[self._version] * len(r) for r in responses],
            prompt_index=[i for i in range(len(prompts)) for _ in range(num_samples)],
            finish_reason=["stop" if r[-1] == 1 else "length" for r in responses],
            entropy=[[1.0] * len(r) for r in responses],
        )


def _encode(tokenizer, text: str, eos: bool) -> list[int]:
    return tokenizer(text)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])


def test_collect_rollouts_layout(tokenizer):
    prompts = [Prompt("1+2=", "3"), Prompt("10+20=", "30")]
    responses = [
        _encode(tokenizer, "1+2=3#3", eos=True),  # correct
        _encode(tokenizer, "#4", eos=True),  # wrong
        _encode(tokenizer, "10+20=30#30", eos=True),  # correct
        _encode(tokenizer, "10+2", eos=False),  # truncated, malformed
    ]
    batch = collect_rollouts(
        ScriptedEngine(responses),
        prompts,
        tokenizer,
        ArithmeticReward(),
        num_samples=2,
        group_id_offset=10,
    )
    prompt_width, response_width = 6, 12
    assert batch.input_ids.shape == (4, prompt_width + response_width)
    assert batch.group_ids.tolist() == [10, 10, 11, 11]
    assert batch.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert batch.correct.tolist() == [True, False, True, False]
    prompt_ids = [tokenizer("1+2=")["input_ids"]] * 2 + [tokenizer("10+20=")["input_ids"]] * 2
    for row, (prompt, response) in enumerate(zip(prompt_ids, responses, strict=True)):
        end = prompt_width + len(response)
        assert batch.input_ids[row, prompt_width - len(prompt) : prompt_width].tolist() == prompt
        assert batch.input_ids[row, prompt_width:end].tolist() == response
        assert batch.mask[row].nonzero().flatten().tolist() == list(range(prompt_width, end))
        assert batch.attention_mask[row].nonzero().flatten().tolist() == list(
            range(prompt_width - len(prompt), end)
        )
        assert batch.rewards[row].nonzero().flatten().tolist() == (
            [end - 1] if batch.scores[row] else []
        )
        assert batch.rewards[row, end - 1] == batch.scores[row]
        assert (batch.versions[row][batch.mask[row]] == 2).all()
        assert (batch.versions[row][~batch.mask[row]] == -1).all()
        assert (batch.behavior_logprobs[row][~batch.mask[row]] == 0).all()
        assert batch.behavior_logprobs[row, prompt_width] == pytest.approx(-0.5)
        assert (batch.entropy[row][batch.mask[row]] == 1).all()
        assert (batch.entropy[row][~batch.mask[row]] == 0).all()
        assert (batch.input_ids[row][~batch.attention_mask[row]] == tokenizer.pad_token_id).all()
    assert batch.info["generated"] == 4 and batch.info["dropped_reward_error"] == 0
    assert batch.info["accuracy"] == 0.5 and batch.info["truncated_fraction"] == 0.25
    assert batch.info["mean_response_length"] == sum(map(len, responses)) / 4
    assert batch.min_versions().tolist() == [2, 2, 2, 2]


class FlakyReward(RewardFunction):
    """Raises for one prompt and returns NaN for another."""

    def __call__(self, prompt: Prompt, completion: str) -> float:
        if prompt.answer == "boom":
            raise RuntimeError("verifier crashed")
        if prompt.answer == "nan":
            return float("nan")
        return 1.0


def test_collect_rollouts_drops_and_counts_reward_errors(tokenizer, caplog):
    prompts = [Prompt("a", "ok"), Prompt("b", "boom"), Prompt("c", "nan")]
    responses = [_encode(tokenizer, "x", eos=True)] * 6
    batch = collect_rollouts(
        ScriptedEngine(responses), prompts, tokenizer, FlakyReward(), num_samples=2
    )
    assert len(batch) == 2 and batch.group_ids.tolist() == [0, 0]
    assert batch.info["generated"] == 6 and batch.info["dropped_reward_error"] == 4
    assert batch.correct.tolist() == [True, True]  # default is_correct: reward > 0
    assert "verifier crashed" in caplog.text


def test_collect_rollouts_with_embedded_engine(actor, tokenizer):
    prompts = [Prompt("1+2=", "3"), Prompt("7+8=", "15")]
    engine = EmbeddedEngine(actor, max_new_tokens=6, seed=0)
    batch = collect_rollouts(engine, prompts, tokenizer, ArithmeticReward(), num_samples=3)
    assert len(batch) == 6 and batch.info["dropped_reward_error"] == 0
    with torch.no_grad():
        logprobs, _ = token_logprobs(actor, batch.input_ids, batch.attention_mask)
    delta = (logprobs - batch.behavior_logprobs)[batch.mask]
    assert delta.abs().max() < 1e-4
    with pytest.raises(ValueError, match="num_samples=0"):
        collect_rollouts(engine, prompts, tokenizer, ArithmeticReward(), num_samples=0)


def test_max_logprob_gap_measures_engine_trainer_mismatch(actor, config):
    from brace_lightning.rollout.collect import generation_batch, max_logprob_gap

    out = EmbeddedEngine(actor, max_new_tokens=8, seed=1).generate(PROMPTS, num_samples=2)
    batch = generation_batch(out)
    assert batch.mask.sum() == sum(len(r) for r in out.response_ids)
    assert max_logprob_gap(actor, batch) < 1e-4
    assert max_logprob_gap(load_causal_lm(config, seed=5), batch) > 1e-2


def test_inverse_cdf_draws_follow_the_distribution_and_skip_zero_mass(actor):
    engine = EmbeddedEngine(actor, seed=0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    draws = engine._draw(probs.expand(40_000, -1))
    counts = torch.bincount(draws, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    expected = 40_000 * probs.double()
    sigma = (expected * (1 - probs.double())).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma).all()
    # A row whose mass sits on one index always draws it, wherever that index is.
    for index in (0, 5):
        point = torch.zeros(1_000, 6)
        point[:, index] = 1.0
        assert (engine._draw(point) == index).all()


def test_preallocated_cache_layer_appends_like_concatenation():
    from brace_lightning.rollout.embedded import _PreallocatedLayer

    layer = _PreallocatedLayer(capacity=7)
    chunks = [torch.randn(2, 3, length, 4) for length in (4, 1, 2)]
    for i in range(len(chunks)):
        keys, values = layer.update(chunks[i], -chunks[i])
        expected = torch.cat(chunks[: i + 1], dim=-2)
        assert torch.equal(keys, expected) and torch.equal(values, -expected)
        assert layer.get_seq_length() == expected.shape[-2]
    with pytest.raises(RuntimeError, match="holds 7 positions; a step needed 8"):
        layer.update(chunks[1], chunks[1])


def test_decoding_padding_mask_matches_the_models_own_mask(config):
    from brace_lightning.rollout.embedded import _decoding_mask_is_padding, _preallocated_cache

    sdpa = load_causal_lm(config, seed=0, attn_implementation="sdpa")
    eager = load_causal_lm(config, seed=0, attn_implementation="eager")
    assert _decoding_mask_is_padding(sdpa, _preallocated_cache(sdpa, 8))
    assert not _decoding_mask_is_padding(eager, _preallocated_cache(eager, 8))
    fast = EmbeddedEngine(sdpa, max_new_tokens=12, seed=4, stop_token_ids=[])
    general = EmbeddedEngine(eager, max_new_tokens=12, seed=4, stop_token_ids=[])
    a, b = fast.generate(PROMPTS, num_samples=2), general.generate(PROMPTS, num_samples=2)
    assert a.response_ids == b.response_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)


def test_sliding_window_layers_keep_the_models_mask(tokenizer):
    from brace_lightning.rollout.embedded import _decoding_mask_is_padding, _preallocated_cache

    def model(window: int | None):
        config = tiny_qwen2_config(
            len(tokenizer), hidden_size=64, num_heads=2, tie_word_embeddings=False
        )
        config.initializer_range = 0.1
        if window is not None:
            config.use_sliding_window, config.sliding_window = True, window
            config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        return load_causal_lm(config, seed=0)

    windowed = model(4)
    assert not _decoding_mask_is_padding(windowed, _preallocated_cache(windowed, 8))
    out = EmbeddedEngine(windowed, max_new_tokens=10, seed=2, stop_token_ids=[]).generate(PROMPTS)
    ids, mask, p = _padded(out)
    with torch.no_grad():
        logprobs, _ = token_logprobs(windowed, ids, mask)
        windowless, _ = token_logprobs(model(None), ids, mask)
    assert (windowless - logprobs)[:, p:].abs().max() > 1e-2  # the window matters here
    for i, response in enumerate(out.response_ids):
        recorded = torch.tensor(out.logprobs[i])
        assert (recorded - logprobs[i, p : p + len(response)]).abs().max() < 1e-4


def test_load_causal_lm_leaves_the_config_alone(config):
    eager = load_causal_lm(config, seed=0, attn_implementation="eager")
    sdpa = load_causal_lm(config, seed=0, attn_implementation="sdpa")
    assert eager.config._attn_implementation == "eager"
    assert sdpa.config._attn_implementation == "sdpa"
    assert eager.config is not config
