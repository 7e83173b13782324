"""Actor (any causal LM), critic (backbone + value head), tokenizers and the supervised warm start."""

from brace_lightning.models.critic import ValueModel
from brace_lightning.models.policy import load_causal_lm, tiny_qwen2_config, token_logprobs
from brace_lightning.models.sources import TINY, load_actor, load_tokenizer
from brace_lightning.models.tokenizer import build_char_tokenizer

__all__ = [
    "TINY",
    "ValueModel",
    "build_char_tokenizer",
    "load_actor",
    "load_causal_lm",
    "load_tokenizer",
    "tiny_qwen2_config",
    "token_logprobs",
]
