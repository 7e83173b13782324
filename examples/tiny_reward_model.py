"""Write a tiny, untrained reward model (a sequence-classification Qwen2 over the character
tokenizer) to a folder, so that ``configs/tasks/reward_model.yaml`` runs offline::

    .venv/bin/python examples/tiny_reward_model.py checkpoints/tiny_reward_model

Its rewards are random but fixed (seeded), one logit per completion; a real run points the
overlay's ``model`` at a trained reward model (a folder or a hub name) instead.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForSequenceClassification, Qwen2Config

from brace_lightning.models.tokenizer import build_char_tokenizer


def write_tiny_reward_model(out: str, *, seed: int = 0) -> None:
    """Save the tiny reward model and its tokenizer to ``out`` (a Hugging Face folder)."""
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the folder to write (created)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_tiny_reward_model(args.out, seed=args.seed)
    print(f"wrote a tiny reward model to {args.out}")


if __name__ == "__main__":
    main()
