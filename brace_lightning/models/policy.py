"""The actor: any Hugging Face causal LM, plus the per-token log-prob computation the trainer uses.

:func:`load_causal_lm` loads a checkpoint (local folder or hub name) or builds a randomly initialised
model from a config (:func:`recompute_nonpersistent_buffers` completes one built on the meta
device); :func:`tiny_qwen2_config` is the small Qwen2 used by tests, tutorials and the
CPU quickstart (head_dim 32 so that vLLM's CPU attention can serve it too).

:func:`token_logprobs` is the one place where log π(token) is computed from a model (by default in
chunks of positions from the final hidden states, see ``models/chunked.py``). The engines
record log µ with the same temperature scaling, so at equal weights the two agree up to float error
(``tests/test_engine.py`` checks it). Layout follows ``rollout/types.py``: the log-prob of the token
at column t comes from the logits at column t − 1 and is stored at column t.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, Qwen2Config

from brace_lightning.models.chunked import (
    accumulation_dtype,
    chunked_head_logit_sq_norms,
    chunked_head_logprobs,
    final_hidden_states,
    linear_lm_head,
    logit_sq_norms,
)


def tiny_qwen2_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    head_dim: int = 32,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
) -> Qwen2Config:
    """A small :class:`~transformers.Qwen2Config` (about 0.5M parameters with the defaults).

    Args:
        vocab_size: number of token ids (``len(tokenizer)``).
        hidden_size: model width; must equal ``num_heads * head_dim`` (vLLM derives head_dim that way).
        num_layers: number of decoder layers.
        num_heads: attention heads.
        head_dim: width of one head; vLLM's CPU attention needs one of 32, 64, 80, 96, 112, 128, ...
        num_kv_heads: key/value heads for grouped-query attention; None means ``num_heads``.
        intermediate_size: MLP width; None means ``4 * hidden_size``.
        max_position_embeddings: longest sequence (prompt + response) the model is used on.
        tie_word_embeddings: share the input embedding and the output projection.
        pad_token_id: padding id (0 for :func:`~brace_lightning.models.tokenizer.build_char_tokenizer`).
        eos_token_id: end-of-sequence id, also used as bos (1 for the char tokenizer).
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
        ("max_position_embeddings", max_position_embeddings),
    ):
        if value < 1:
            raise ValueError(f"tiny_qwen2_config got {name}={value}; expected a positive integer.")
    if hidden_size != num_heads * head_dim:
        raise ValueError(
            f"tiny_qwen2_config got hidden_size={hidden_size}; expected num_heads * head_dim = "
            f"{num_heads * head_dim}."
        )
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"tiny_qwen2_config got num_kv_heads={num_kv_heads}; expected a positive divisor of "
            f"num_heads={num_heads}."
        )
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size if intermediate_size is None else intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
    )


def load_causal_lm(
    source: str | PretrainedConfig,
    *,
    dtype: torch.dtype | str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    seed: int | None = None,
) -> PreTrainedModel:
    """Load a causal LM with ``AutoModelForCausalLM``.

    Args:
        source: a local folder or hub name (``from_pretrained``), or a config (``from_config``, random
            initialisation).
        dtype: parameter dtype (``torch.bfloat16``, ``"bfloat16"``, ``"auto"``); None keeps the
            library default (float32 for a config, the checkpoint's for ``"auto"``).
        revision: hub revision (branch, tag or commit) when ``source`` is a hub name.
        trust_remote_code: allow custom modelling code from the checkpoint.
        attn_implementation: ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``, ...; None = default.
        seed: when building from a config, the seed of the random initialisation (the global RNG is
            left untouched); ignored for checkpoints.

    Returns:
        The model in eval mode in both cases, as ``from_pretrained`` returns it (Lightning switches
        it to train mode during fit).
    """
    kwargs: dict[str, object] = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if isinstance(source, PretrainedConfig):
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            # from_config keeps the config object and writes the attention choice into it: a copy
            # leaves the caller's config, and models built from it earlier, untouched.
            return AutoModelForCausalLM.from_config(copy.deepcopy(source), **kwargs).eval()
    if not isinstance(source, str):
        raise ValueError(
            f"load_causal_lm got source of type {type(source).__name__}; expected a path, a hub name "
            "or a transformers PretrainedConfig."
        )
    return AutoModelForCausalLM.from_pretrained(source, revision=revision, **kwargs)


def recompute_nonpersistent_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Rebuild the non-persistent buffers (e.g. rotary ``inv_freq``) of a model built on the meta
    device, which neither ``load_state_dict`` nor ``to_empty`` fills, from a fresh CPU instance of
    the owning module built from its config.

    Raises:
        ValueError: when a module with non-persistent buffers holds no transformers config.
    """
    for module in model.modules():
        names = getattr(module, "_non_persistent_buffers_set", set())
        if not names:
            continue
        config = getattr(module, "config", None)
        if not isinstance(config, PretrainedConfig):
            raise ValueError(
                f"recompute_nonpersistent_buffers cannot rebuild the non-persistent buffers {sorted(names)} of "
                f"{type(module).__name__}; expected the module to hold a transformers config."
            )
        fresh = type(module)(config)
        for name in names:
            module.register_buffer(name, getattr(fresh, name).to(device), persistent=False)


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: ``cumsum(attention_mask) − 1``, clamped at 0.

    Args:
        attention_mask: ``[B, T]`` bool or integer, 1 at real tokens.

    Returns:
        ``[B, T]`` long; the first real token of every row gets position 0, padding gets 0.
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


#: Positions per chunk of :func:`token_logprobs`' chunked path: peak extra memory is a few
#: ``[DEFAULT_CHUNK_SIZE, V]`` float32 blocks (about 0.16 GB each at V = 151,936). 256 rather than
#: 1024: at the Qwen2.5-0.5B shape and T = 4096 it peaks 5.0× below the full path (1024: 3.7×) in
#: 1.01× its time (1024: 0.96×; docs/benchmarks.md).
DEFAULT_CHUNK_SIZE = 256


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token under ``model``, stored at the token's own column.

    ``logprobs[b, t] = log_softmax(logits[b, t − 1] / temperature)[input_ids[b, t]]`` and
    ``entropy[b, t] = H(softmax(logits[b, t − 1] / temperature))``, computed in float32 (float64
    for a float64 model). Column 0
    and every column whose token or predecessor is padding get 0. Gradients flow (the trainer calls
    this for π); wrap it in ``torch.no_grad()`` for evaluation.

    With ``chunk_size`` set and a plain linear LM head (:func:`~brace_lightning.models.chunked.
    linear_lm_head`), the model returns only its final hidden states and the head is applied to
    ``chunk_size`` real positions at a time (:func:`~brace_lightning.models.chunked.
    chunked_head_logprobs`), so ``[B, T, V]`` never exists; the values equal the full path's to
    float32 round-off. Otherwise the full logits are computed as before.

    Args:
        model: a causal LM returning ``.logits`` of shape ``[B, T, V]``.
        input_ids: ``[B, T]`` long, prompts left-padded (``rollout/types.py`` layout).
        attention_mask: ``[B, T]`` bool or integer, True at real tokens.
        temperature: the sampling temperature the engine used; must be > 0.
        return_entropy: also return the per-position entropy.
        chunk_size: positions per chunk of the chunked path; None forces the full path.

    Returns:
        ``(logprobs, entropy)``, both ``[B, T]`` float32 (float64 for a float64 model);
        ``entropy`` is None unless requested.
    """
    inputs, valid, head = _head_inputs(
        "token_logprobs", model, input_ids, attention_mask, temperature, chunk_size
    )
    if head is not None:
        hidden = final_hidden_states(model, **inputs)[:, :-1][valid]  # [N, H], real positions only
        picked, ent = chunked_head_logprobs(
            hidden,
            head,
            input_ids[:, 1:][valid],
            temperature=temperature,
            chunk_size=chunk_size,
            return_entropy=return_entropy,
        )
        logprobs = _scatter_columns(picked, valid)
        return logprobs, None if ent is None else _scatter_columns(ent, valid)
    logits = model(**inputs, use_cache=False).logits
    logits = logits[:, :-1].to(accumulation_dtype(logits.dtype)) / temperature  # [B, T-1, V]
    log_z = torch.logsumexp(logits, dim=-1)  # [B, T-1]
    picked = logits.gather(-1, input_ids[:, 1:, None]).squeeze(-1) - log_z
    logprobs = _pad_columns(picked, valid)
    if not return_entropy:
        return logprobs, None
    log_p = logits - log_z[..., None]
    return logprobs, _pad_columns(-(log_p.exp() * log_p).sum(dim=-1), valid)


def token_logit_sq_norms(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """``[B, T]``: at every token's own column, the squared norm of its log-prob's gradient with
    respect to the logits that predict it (:func:`~brace_lightning.models.chunked.logit_sq_norms`),
    laid out and zeroed as :func:`token_logprobs`, whose arguments these are; no graph is built.
    A response's sum is the forward-only proxy of its score-gradient norm (verl's optimal baseline
    and OTB)."""
    inputs, valid, head = _head_inputs(
        "token_logit_sq_norms", model, input_ids, attention_mask, temperature, chunk_size
    )
    with torch.no_grad():
        if head is not None:
            hidden = final_hidden_states(model, **inputs)[:, :-1][valid]
            norms = chunked_head_logit_sq_norms(
                hidden,
                head,
                input_ids[:, 1:][valid],
                temperature=temperature,
                chunk_size=chunk_size,
            )
            return _scatter_columns(norms, valid)
        logits = model(**inputs, use_cache=False).logits[:, :-1]
        z = logits.to(accumulation_dtype(logits.dtype)) / temperature
        norms = logit_sq_norms(torch.log_softmax(z, dim=-1), input_ids[:, 1:], temperature)
        return _pad_columns(norms, valid)


def _head_inputs(
    caller: str,
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    chunk_size: int | None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.nn.Linear | None]:
    """The checked arguments of a per-token pass over padded rows (``caller`` names it in the
    errors): the model's inputs (with position ids), ``valid`` ``[B, T − 1]`` (a position and its
    successor are both real) and the LM head of the chunked path (None: the full logits)."""
    if not temperature > 0:
        raise ValueError(f"{caller} got temperature={temperature}; expected a value > 0.")
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"{caller} got attention_mask of shape {tuple(attention_mask.shape)}; expected "
            f"[B, T] equal to input_ids' {tuple(input_ids.shape)}."
        )
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(
            f"{caller} got chunk_size={chunk_size!r}; expected None or an integer >= 1."
        )
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_attention_mask(attention_mask),
    }
    real = attention_mask.bool()
    valid = real[:, 1:] & real[:, :-1]
    return inputs, valid, None if chunk_size is None else linear_lm_head(model)


def _pad_columns(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, T − 1]`` per-position values of the full path laid out as ``[B, T]``: column 0 and
    every position not ``valid`` get 0 (``torch.where``, not a product, so garbage logits at
    padding can never leak into the result)."""
    zeros = values.new_zeros(values.shape[0], 1)
    return torch.cat([zeros, torch.where(valid, values, torch.zeros_like(values))], dim=1)


def _scatter_columns(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[N]`` values of the positions where ``valid`` (``[B, T − 1]``) is True, laid out as
    ``[B, T]`` with column 0 and every other position 0 (differentiable)."""
    out = values.new_zeros(valid.shape).masked_scatter(valid, values)
    return torch.cat([values.new_zeros(valid.shape[0], 1), out], dim=1)
