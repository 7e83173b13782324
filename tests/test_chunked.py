"""Chunked log-probs and entropy from final hidden states (``models/chunked.py``) against the full
``[B, T, V]`` path of ``token_logprobs``: values, gradients, float64 gradcheck and the fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import OPTConfig

from brace_lightning.models.chunked import (
    chunked_head_logit_sq_norms,
    chunked_head_logprobs,
    linear_lm_head,
    logit_sq_norms,
)
from brace_lightning.models.policy import (
    load_causal_lm,
    tiny_qwen2_config,
    token_logit_sq_norms,
    token_logprobs,
)


def _left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = True
    return ids, mask


ROWS = [[5, 9, 13, 7, 20, 31, 2], [40, 41, 42], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def actor() -> nn.Module:
    config = tiny_qwen2_config(
        97, hidden_size=64, num_heads=2, max_position_embeddings=64, tie_word_embeddings=False
    )
    return load_causal_lm(config, seed=3)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_chunked_equals_full(
    model: nn.Module, chunk_size: int, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """Log-probs, entropy and every parameter's gradient of a weighted loss over :data:`ROWS`:
    chunked equal to the full path within float32 round-off. Returns the full path's gradients."""
    ids, mask = _left_pad(ROWS)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    results = {}
    for name, size in (("full", None), ("chunked", chunk_size)):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = token_logprobs(
            model, ids, mask, temperature=temperature, return_entropy=True, chunk_size=size
        )
        (logprobs * weights + 0.3 * entropy * weights.flip(1)).sum().backward()
        results[name] = (logprobs.detach(), entropy.detach(), _grads(model))
    model.zero_grad(set_to_none=True)
    full, chunked = results["full"], results["chunked"]
    torch.testing.assert_close(chunked[0], full[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked[1], full[1], rtol=1e-5, atol=1e-5)
    assert (chunked[0][~mask] == 0).all() and (chunked[0][:, 0] == 0).all()
    assert full[2].keys() == chunked[2].keys()
    for name, grad in full[2].items():
        torch.testing.assert_close(chunked[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    return full[2]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_chunked_values_and_gradients_equal_full_path(actor, temperature, chunk_size):
    assert "lm_head.weight" in assert_chunked_equals_full(actor, chunk_size, temperature)


def test_a_head_fed_outside_the_base_models_forward_gives_the_full_paths_values_and_gradients():
    # OPT's causal LM runs its decoder directly (OPTModel.forward never runs) and projects the
    # hidden states to the embedding width before the head: the head's input is what counts
    config = OPTConfig(
        vocab_size=97,
        hidden_size=32,
        word_embed_proj_dim=16,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
    )
    model = load_causal_lm(config, seed=0)
    assert linear_lm_head(model) is model.lm_head
    gradients = assert_chunked_equals_full(model, chunk_size=4, temperature=0.6)
    # the tied embedding (the head's weight) and the projection both get their gradients
    assert {"model.decoder.embed_tokens.weight", "model.decoder.project_out.weight"} <= set(
        gradients
    )


def test_chunked_never_builds_full_logits(actor, monkeypatch):
    """The chunked path asks the model for no logits and applies the head to chunks only."""
    ids, mask = _left_pad(ROWS)
    widths = []
    head_forward = actor.lm_head.forward
    monkeypatch.setattr(
        actor.lm_head, "forward", lambda x: widths.append(x.shape[-2]) or head_forward(x)
    )
    with torch.no_grad():
        token_logprobs(actor, ids, mask, chunk_size=4)
    assert widths == [0]  # the model's own call, with logits_to_keep an empty index


def test_gradcheck_float64_with_bias_and_temperature():
    gen = torch.Generator().manual_seed(1)
    head = nn.Linear(6, 11, bias=True).double()
    hidden = torch.randn(7, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=gen)

    def both(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        del head.weight, head.bias
        head.weight, head.bias = w, b  # plain tensors, so gradcheck sees the dependence
        return chunked_head_logprobs(
            h, head, targets, temperature=0.7, chunk_size=3, return_entropy=True
        )

    weight = head.weight.detach().clone().requires_grad_(True)
    bias = head.bias.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(both, (hidden, weight, bias), eps=1e-6, atol=1e-8)


def test_gradcheck_float64_tiny_model():
    """Both paths agree in float64 to 1e-12, and gradcheck passes through a tiny Qwen2's LM head
    and final norm (the chunked path's custom backward feeds both)."""
    config = tiny_qwen2_config(
        23,
        hidden_size=32,
        num_heads=1,
        num_layers=1,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    model = load_causal_lm(config, seed=0).double()
    ids, mask = _left_pad([[3, 4, 5, 6, 7], [8, 9, 10]])
    full = token_logprobs(model, ids, mask, temperature=0.8, return_entropy=True, chunk_size=None)
    chunked = token_logprobs(model, ids, mask, temperature=0.8, return_entropy=True, chunk_size=2)
    for got, expected in zip(chunked, full, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)

    head, norm = model.lm_head, model.model.norm
    saved = head.weight, norm.weight

    def chunked_of(w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        del head.weight, norm.weight
        head.weight, norm.weight = w, g  # plain tensors, so gradcheck sees the dependence
        try:
            return token_logprobs(
                model, ids, mask, temperature=0.8, return_entropy=True, chunk_size=2
            )
        finally:
            del head.weight, norm.weight
            head.weight, norm.weight = saved

    inputs = tuple(t.detach().clone().requires_grad_(True) for t in saved)
    assert torch.autograd.gradcheck(chunked_of, inputs, eps=1e-6, atol=1e-7)


class _ScaledHead(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * self.linear(x)


def test_non_linear_head_falls_back_to_full_path():
    config = tiny_qwen2_config(31, hidden_size=32, num_heads=1, max_position_embeddings=16)
    model = load_causal_lm(config, seed=0)
    assert linear_lm_head(model) is model.lm_head
    model.lm_head = _ScaledHead(model.lm_head)
    assert linear_lm_head(model) is None
    ids, mask = _left_pad([[3, 4, 5, 6], [7, 8]])
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, ids, mask, chunk_size=2)
        logits = model(input_ids=ids[:1]).logits[0].double()
    expected = logits.log_softmax(-1)[torch.arange(3), ids[0, 1:]]
    torch.testing.assert_close(logprobs[0, 1:].double(), expected, rtol=1e-5, atol=1e-5)
    config.final_logit_softcapping = 30.0
    assert linear_lm_head(load_causal_lm(config, seed=0)) is None


def test_bad_chunk_size_is_one_sentence(actor):
    ids, mask = _left_pad(ROWS)
    with pytest.raises(ValueError, match="chunk_size=0"):
        token_logprobs(actor, ids, mask, chunk_size=0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logit_sq_norms_are_the_logit_gradient_norms_and_keep_their_precision_near_p_1(
    temperature: float,
) -> None:
    """‖∂ log softmax(l / τ)_y / ∂ l‖² against float64 autograd, per position; in float32 it stays
    within 1% where p_y ≈ 1 − 1e-4 (there 1 − 2 p_y + Σ p² cancels to float32 noise), and the
    chunked head gives the same numbers chunk by chunk."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g, dtype=torch.float64) * 3 * temperature
    logits[0, 4] = 14.0 * temperature  # p_y ≈ 1 − 1e-4
    targets = torch.tensor([4, 0, 3, 10, 5, 5, 1])
    leaf = logits.clone().requires_grad_(True)
    picked = torch.log_softmax(leaf / temperature, dim=-1).gather(-1, targets[:, None])
    want = torch.stack(
        [
            torch.autograd.grad(picked[i, 0], leaf, retain_graph=True)[0].square().sum()
            for i in range(len(targets))
        ]
    )
    got64 = logit_sq_norms(torch.log_softmax(logits / temperature, -1), targets, temperature)
    torch.testing.assert_close(got64, want, rtol=1e-12, atol=0.0)
    z32 = logits.float() / temperature
    got32 = logit_sq_norms(torch.log_softmax(z32, -1), targets, temperature)
    torch.testing.assert_close(got32.double(), want, rtol=1e-2, atol=0.0)
    p = torch.softmax(z32, -1)
    naive = (1 - 2 * p.gather(-1, targets[:, None])[:, 0] + p.square().sum(-1)) / temperature**2
    assert abs(float(naive[0]) - float(want[0])) > 0.5 * float(want[0])  # cancelled to noise
    head = nn.Linear(11, 11, bias=True).double()
    with torch.no_grad():
        head.weight.copy_(torch.eye(11))
        head.bias.zero_()
    chunked = chunked_head_logit_sq_norms(
        logits, head, targets, temperature=temperature, chunk_size=3
    )
    torch.testing.assert_close(chunked, want, rtol=1e-9, atol=0.0)


@pytest.mark.parametrize("fn", [token_logprobs, token_logit_sq_norms])
def test_the_padded_passes_refuse_bad_arguments_in_one_sentence_naming_themselves(fn) -> None:
    ids, mask = _left_pad(ROWS)
    model = nn.Linear(2, 2)  # never run: the arguments are checked first
    name = fn.__name__
    with pytest.raises(ValueError, match=f"^{name} got temperature=0; expected a value > 0.$"):
        fn(model, ids, mask, temperature=0)
    with pytest.raises(ValueError, match=f"^{name} got chunk_size=0; expected None or an integer"):
        fn(model, ids, mask, chunk_size=0)
    with pytest.raises(ValueError, match=rf"^{name} got attention_mask of shape \(3, 9\)"):
        fn(model, ids, mask[:, 1:])
