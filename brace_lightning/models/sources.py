"""Resolve the one ``actor`` string of a recipe into a tokenizer, an actor and a critic.

``"tiny-char"`` is the built-in CPU configuration: the character tokenizer of
:mod:`brace_lightning.models.tokenizer` and a randomly initialised :func:`tiny_qwen2_config` model.
Anything else is a local folder or a Hugging Face hub name (loaded with ``transformers``; the hub
needs network access).
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from brace_lightning.models.policy import load_causal_lm, tiny_qwen2_config
from brace_lightning.models.tokenizer import build_char_tokenizer

TINY = "tiny-char"


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``source`` (``"tiny-char"``, a local folder or a hub name)."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"tokenizer source must be a non-empty string; got {source!r}.")
    if source == TINY:
        return build_char_tokenizer()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as error:
        raise ValueError(
            f"tokenizer source {source!r} is neither 'tiny-char', a local model folder, nor a "
            f"reachable hub name ({error.__class__.__name__})."
        ) from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_actor(
    source: str,
    *,
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 128,
    num_layers: int = 2,
    seed: int = 0,
) -> PreTrainedModel:
    """The actor of ``source``; ``"tiny-char"`` builds a random tiny Qwen2 sized by the arguments.

    Args:
        source: ``"tiny-char"``, a local folder or a hub name.
        tokenizer: the matching tokenizer (gives the vocabulary size and special ids of tiny models).
        hidden_size, num_layers: size of the tiny model (ignored for checkpoints); head_dim is 32.
        seed: seed of the tiny model's random initialisation (the global RNG is left untouched).
    """
    if source != TINY:
        try:
            return load_causal_lm(source)
        except OSError as error:
            raise ValueError(
                f"actor {source!r} is neither 'tiny-char', a local model folder, nor a reachable "
                f"hub name ({error.__class__.__name__})."
            ) from error
    if hidden_size % 32:
        raise ValueError(f"hidden_size must be a multiple of 32 (head_dim 32); got {hidden_size}.")
    config = tiny_qwen2_config(
        len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=hidden_size // 32,
        head_dim=32,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return load_causal_lm(config)
