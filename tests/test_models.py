"""Tokenizer, actor/critic construction, token log-probs and the supervised warm start."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from brace_lightning.models.critic import ValueModel, critic_seed, init_value_head
from brace_lightning.models.policy import (
    load_causal_lm,
    position_ids_from_attention_mask,
    tiny_qwen2_config,
    token_logprobs,
)
from brace_lightning.models.tokenizer import CHARACTERS, build_char_tokenizer
from brace_lightning.warmstart import _encode_pairs, supervised_warm_start


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def config(tokenizer):
    return tiny_qwen2_config(
        len(tokenizer), hidden_size=64, num_heads=2, max_position_embeddings=128
    )


@pytest.fixture(scope="module")
def actor(config):
    return load_causal_lm(config, seed=0)


def _left_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = True
    return ids, mask


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_every_character(tokenizer):
    texts = [
        CHARACTERS,
        "12+7=19;19+5=24#24",
        "Question: 3 apples?\nAnswer: <<2*3=6>>6 #### 6",
        " ",
    ]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == len(text)
        assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 1)
    assert len(tokenizer) == 3 + len(CHARACTERS)
    ids = tokenizer("1+1=2")["input_ids"]
    assert tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True) == "1+1=2"
    assert tokenizer("a€b")["input_ids"][1] == tokenizer.unk_token_id


def test_tokenizer_save_and_reload(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Mara has 14 marbles; 14 + 9 = 23.\n#### 23"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.decode(reloaded(text)["input_ids"]) == text
    assert reloaded.pad_token_id == 0 and reloaded.eos_token_id == 1


# ---------------------------------------------------------------- actor


def test_tiny_config_values_and_validation():
    config = tiny_qwen2_config(100)
    assert config.head_dim == 32 and config.hidden_size == 128 and config.num_hidden_layers == 2
    assert config.tie_word_embeddings and config.pad_token_id == 0 and config.eos_token_id == 1
    with pytest.raises(ValueError, match="hidden_size=100"):
        tiny_qwen2_config(100, hidden_size=100)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        tiny_qwen2_config(100, num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab_size=0"):
        tiny_qwen2_config(0)


def test_load_causal_lm_seeded_from_config_and_from_disk(config, actor, tmp_path):
    state = torch.get_rng_state()
    again = load_causal_lm(config, seed=0)
    assert torch.equal(state, torch.get_rng_state()), "seeded init must not touch the global RNG"
    for (name, a), (_, b) in zip(
        actor.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    other = load_causal_lm(config, seed=1)
    assert not torch.equal(other.lm_head.weight, actor.lm_head.weight)

    actor.save_pretrained(tmp_path)
    loaded = load_causal_lm(str(tmp_path))
    for name, value in actor.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    half = load_causal_lm(str(tmp_path), dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16
    assert not again.training and not loaded.training

    critic = ValueModel.from_pretrained(str(tmp_path))
    backbone = actor.base_model.state_dict()
    for name, value in critic.backbone.state_dict().items():
        assert torch.equal(value, backbone[name]), name


def test_load_causal_lm_rejects_other_sources():
    with pytest.raises(ValueError, match="source of type int"):
        load_causal_lm(3)  # type: ignore[arg-type]


def test_position_ids_from_left_padded_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    assert torch.equal(position_ids_from_attention_mask(mask), expected)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_manual_loop(actor, temperature):
    rows = [[5, 9, 13, 7, 20, 31], [40, 41, 42], [3, 4, 5, 6, 7, 8, 9, 10]]
    ids, mask = _left_pad(rows)
    with torch.no_grad():
        logprobs, entropy = token_logprobs(
            actor, ids, mask, temperature=temperature, return_entropy=True
        )
    assert logprobs.shape == entropy.shape == ids.shape and logprobs.dtype == torch.float32
    width = ids.shape[1]
    for b, row in enumerate(rows):
        with torch.no_grad():
            logits = actor(input_ids=torch.tensor([row])).logits[0].double() / temperature
        log_p = logits.log_softmax(-1)
        offset = width - len(row)
        assert (logprobs[b, : offset + 1] == 0).all() and (entropy[b, : offset + 1] == 0).all()
        for t in range(1, len(row)):
            manual = log_p[t - 1, row[t]]
            manual_entropy = -(log_p[t - 1].exp() * log_p[t - 1]).sum()
            assert abs(float(logprobs[b, offset + t]) - float(manual)) < 1e-5
            assert abs(float(entropy[b, offset + t]) - float(manual_entropy)) < 1e-5


def test_token_logprobs_entropy_flag_and_gradients(actor):
    ids, mask = _left_pad([[5, 6, 7, 8], [9, 10]])
    logprobs, entropy = token_logprobs(actor, ids, mask)
    assert entropy is None
    logprobs.sum().backward()
    assert actor.lm_head.weight.grad is not None
    assert torch.isfinite(actor.lm_head.weight.grad).all()
    actor.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs(actor, ids, mask, temperature=0.0)
    with pytest.raises(ValueError, match="attention_mask of shape"):
        token_logprobs(actor, ids, mask[:, 1:])


# ---------------------------------------------------------------- critic


def test_value_model_shapes_padding_and_small_init(actor):
    critic = ValueModel.from_actor(actor, seed=0)
    rows = [[5, 6, 7, 8, 9], [10, 11]]
    ids, mask = _left_pad(rows)
    values = critic(ids, mask)
    assert values.shape == ids.shape and values.dtype == torch.float32
    assert (values[~mask] == 0).all()
    assert values.abs().max() < 0.1  # small head init: values start near 0
    alone = critic(torch.tensor([rows[1]]), torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(values[1, -2:], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("hidden", [16, 64, 896])
def test_init_value_head_with_a_generator_draws_the_former_sharded_head(hidden):
    # meta_init drew the sharded critic's head as randn(shape) * std; the one initialisation
    # must give the same numbers from the same generator (heads of >= 16 weights).
    weight, bias = torch.empty(1, hidden), torch.ones(1)
    init_value_head(weight, bias, std=1e-3, generator=torch.Generator().manual_seed(5))
    former = torch.randn((1, hidden), generator=torch.Generator().manual_seed(5)) * 1e-3
    assert torch.equal(weight, former) and torch.equal(bias, torch.zeros(1))


def test_value_model_head_is_init_value_head_from_the_global_generator(actor):
    torch.manual_seed(11)
    critic = ValueModel(actor.base_model, head_init_std=0.5)
    torch.manual_seed(11)
    head = torch.nn.Linear(critic.value_head.in_features, 1)  # draws its own init first, as there
    init_value_head(head.weight, head.bias, std=0.5)
    assert torch.equal(critic.value_head.weight, head.weight)
    assert torch.equal(critic.value_head.bias, torch.zeros(1))


def test_critic_seed_differs_from_the_run_seed():
    assert [critic_seed(s) for s in (0, 7)] == [1, 8]


def test_value_model_from_actor_copies_weights_into_separate_storage(actor):
    critic = ValueModel.from_actor(actor)
    actor_backbone = actor.base_model.state_dict()
    for name, value in critic.backbone.state_dict().items():
        assert torch.equal(value, actor_backbone[name]), name
        assert value.data_ptr() != actor_backbone[name].data_ptr(), name
    fresh = ValueModel.from_actor(actor, copy_weights=False, seed=1)
    emb = "embed_tokens.weight"
    assert not torch.equal(fresh.backbone.state_dict()[emb], actor_backbone[emb])
    assert not hasattr(critic.backbone, "lm_head")


def test_value_model_trains_without_touching_actor(actor, config):
    critic = ValueModel.from_config(config, seed=0)
    before = actor.base_model.embed_tokens.weight.clone()
    ids, mask = _left_pad([[5, 6, 7], [8, 9]])
    critic(ids, mask).sum().backward()
    assert critic.value_head.weight.grad is not None
    assert critic.backbone.embed_tokens.weight.grad is not None
    assert actor.base_model.embed_tokens.weight.grad is None
    assert torch.equal(before, actor.base_model.embed_tokens.weight)
    with pytest.raises(ValueError, match="actor of type Linear"):
        ValueModel.from_actor(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


# ---------------------------------------------------------------- warm start


def test_warm_start_masks_prompt_and_appends_eos(tokenizer):
    [(ids, labels)] = _encode_pairs(tokenizer, [("1+2=", "1+2=3#3")])
    assert ids == tokenizer("1+2=1+2=3#3")["input_ids"] + [tokenizer.eos_token_id]
    assert labels[:4] == [-100] * 4 and labels[4:] == ids[4:]


def test_warm_start_lowers_loss_and_restores_mode(config, tokenizer):
    model = load_causal_lm(config, seed=0)
    model.eval()
    pairs = [("1+2=", "1+2=3#3"), ("4+4=", "4+4=8#8"), ("7+1=", "7+1=8#8")]
    losses = supervised_warm_start(model, tokenizer, pairs, steps=40, batch_size=3, lr=1e-2)
    assert len(losses) == 40 and losses[-1] < 0.5 * losses[0]
    assert not model.training
    with pytest.raises(ValueError, match="no pairs"):
        supervised_warm_start(model, tokenizer, [], steps=1, batch_size=1, lr=1e-3)
    with pytest.raises(ValueError, match="steps=0"):
        supervised_warm_start(model, tokenizer, pairs, steps=0, batch_size=1, lr=1e-3)
