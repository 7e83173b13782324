"""Resolve the one ``actor`` string of a recipe into a tokenizer, an actor and a critic.

``"tiny-char"`` is the built-in CPU configuration: the character tokenizer of
:mod:`brace_lightning.models.tokenizer` and a randomly initialised :func:`tiny_qwen2_config` model.
Anything else is a local folder or a Hugging Face hub name (loaded with ``transformers``; the hub
needs network access). Without network, ``huggingface_hub`` retries a name for about a minute before
it gives up, so :func:`use_cache_when_offline` first tries one TCP connection to the hub (a few
seconds at most) and, when it fails, switches the process (and the processes it starts) to
``HF_HUB_OFFLINE``: cached models still load, an unknown name fails at once in one sentence.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import huggingface_hub.constants
import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from brace_lightning.models.policy import load_causal_lm, tiny_qwen2_config
from brace_lightning.models.tokenizer import build_char_tokenizer

TINY = "tiny-char"

#: Seconds the one connection to the hub may take before the hub counts as unreachable.
HUB_CONNECT_TIMEOUT = 3.0

logger = logging.getLogger(__name__)


def hub_reachable(endpoint: str, timeout: float = HUB_CONNECT_TIMEOUT) -> bool:
    """Whether one TCP connection to ``endpoint`` (``https://huggingface.co``) opens in ``timeout``
    seconds; True behind a proxy (``HTTPS_PROXY``/``HTTP_PROXY``), which a direct connection
    cannot judge."""
    if any(
        os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
    ):
        return True
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


@functools.cache
def use_cache_when_offline() -> bool:
    """True when the process loads models from the local cache only: ``HF_HUB_OFFLINE`` was set,
    or the hub is unreachable, in which case it is set here (in ``huggingface_hub`` and in the
    environment, for spawned producers and servers) with one logged line. Checked once."""
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return True
    endpoint = huggingface_hub.constants.ENDPOINT
    if hub_reachable(endpoint):
        return False
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    logger.warning(
        "The Hugging Face hub (%s) is not reachable: models load from the local cache only "
        "(HF_HUB_OFFLINE=1).",
        endpoint,
    )
    return True


def _not_found(what: str, source: str, error: Exception) -> ValueError:
    if not Path(source).exists() and use_cache_when_offline():
        return ValueError(
            f"{what} {source!r} is neither 'tiny-char', a local model folder, nor a model in the "
            "Hugging Face cache, and the hub is not reachable (offline): check the name, or "
            "download the model where the hub is reachable and pass its folder."
        )
    return ValueError(
        f"{what} {source!r} is neither 'tiny-char', a local model folder, nor a reachable hub "
        f"name ({error.__class__.__name__})."
    )


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``source`` (``"tiny-char"``, a local folder or a hub name)."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"tokenizer source must be a non-empty string; got {source!r}.")
    if source == TINY:
        return build_char_tokenizer()
    if not Path(source).exists():
        use_cache_when_offline()  # no minute of retries for a name the hub cannot be asked about
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as error:
        raise _not_found("tokenizer source", source, error) from error
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
        if not Path(source).exists():
            use_cache_when_offline()
        try:
            return load_causal_lm(source)
        except OSError as error:
            raise _not_found("actor", source, error) from error
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
