"""Packed sequences (``models/packing.py``) against the padded path, Qwen2- and Llama-shaped: the
actor's log-probs, the critic's values, and the check that refuses models which cannot pack."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import BloomConfig, FalconConfig, LlamaConfig

from brace_lightning.models.critic import ValueModel
from brace_lightning.models.packing import (
    pack_rows,
    packed_token_logprobs,
    packed_values,
    packing_problem,
)
from brace_lightning.models.policy import load_causal_lm, tiny_qwen2_config, token_logprobs


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows of lengths 9, 3, 1 and 12."""
    gen = torch.Generator().manual_seed(0)
    lengths = [9, 3, 1, 12]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(2, vocab, (n,), generator=gen)
        mask[i, -n:] = True
    return ids, mask


def _models() -> list[torch.nn.Module]:
    qwen = tiny_qwen2_config(
        97, hidden_size=64, num_heads=2, num_kv_heads=1, tie_word_embeddings=False
    )
    llama = LlamaConfig(
        vocab_size=89,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return [load_causal_lm(qwen, seed=0), load_causal_lm(llama, seed=1)]


def test_pack_rows_restarts_positions():
    ids, mask = _batch(50)
    packed, positions = pack_rows(ids, mask)
    assert packed.shape == positions.shape == (1, 25)
    assert positions[0].tolist() == [*range(9), *range(3), 0, *range(12)]
    assert packed[0, :9].tolist() == ids[0, -9:].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_and_gradients_equal_padded(temperature):
    for model in _models():
        ids, mask = _batch(model.config.vocab_size)
        weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
        results = []
        for fn in (token_logprobs, packed_token_logprobs):
            model.zero_grad(set_to_none=True)
            lp, ent = fn(model, ids, mask, temperature=temperature, return_entropy=True)
            ((lp * weights).sum() + ent.sum()).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            results.append((lp.detach(), ent.detach(), grads))
        (lp0, ent0, g0), (lp1, ent1, g1) = results
        torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
        assert (lp1[~mask] == 0).all() and (lp1[2] == 0).all()
        for name, grad in g0.items():
            torch.testing.assert_close(g1[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_packed_values_and_gradients_equal_padded():
    for actor in _models():
        critic = ValueModel.from_actor(actor, seed=3, head_init_std=0.1)
        ids, mask = _batch(actor.config.vocab_size)
        weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
        results = []
        for values_of in (critic, functools.partial(packed_values, critic)):
            critic.zero_grad(set_to_none=True)
            values = values_of(ids, mask)
            (values * weights).sum().backward()
            grads = {n: p.grad.clone() for n, p in critic.named_parameters()}
            results.append((values.detach(), grads))
        (v0, g0), (v1, g1) = results
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-6)
        assert (v1[~mask] == 0).all()
        for name, grad in g0.items():
            torch.testing.assert_close(g1[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_packing_problem_passes_qwen2_and_llama_actors_and_critics():
    for actor in _models():
        for model in (actor.train(), ValueModel.from_actor(actor)):
            assert packing_problem(model) is None, type(model).__name__
            assert model.training  # the probe runs in eval mode, then restores the mode


def test_packing_problem_names_models_that_cannot_pack():
    # Falcon takes position ids but does not pass them to its mask: its packed rows attend to each
    # other, which only running the model shows. BLOOM (ALiBi) takes no position ids at all.
    falcon = load_causal_lm(
        FalconConfig(vocab_size=89, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
        seed=0,
    )
    for model in (falcon, ValueModel.from_actor(falcon)):
        assert "packed rows do not match the rows run one by one" in packing_problem(model)
    bloom = load_causal_lm(
        BloomConfig(vocab_size=89, hidden_size=32, n_layer=2, n_head=4),
        seed=0,
        attn_implementation="eager",
    )
    assert packing_problem(bloom) == "BloomModel.forward takes no position_ids"
    qwen = _models()[0]
    qwen.config._attn_implementation = "paged|eager"
    assert packing_problem(qwen) == (
        "transformers builds no packed-sequence mask for attention 'paged|eager'"
    )
