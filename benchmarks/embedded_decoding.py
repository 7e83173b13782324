"""Generation time of the embedded engine against the decoding loop it replaced and HF ``generate``.

    python -m benchmarks.embedded_decoding [--repeats 7] [--sizes 32x1 64x1 128x2] [--tokens 200]

One rollout batch as ``benchmarks/async_speedup.py`` generates it: 16 arithmetic prompts x 4 samples,
exactly ``--tokens`` new tokens (no stop token), temperature 1, one torch thread, for each tiny Qwen2
size (hidden x layers, tiny-char vocabulary). Rows, each timed in the same process, interleaved
within a repeat:

- *engine*: :meth:`EmbeddedEngine.generate` (preallocated key/value cache and mask, a padding mask
  view per decoding step, inverse-CDF sampling), recording log-probs, entropies and versions;
- *former loop*: the engine's decoding loop before those changes, which grew a ``DynamicCache``
  and the attention mask by concatenation, let the model build its mask at every step and sampled
  with ``torch.multinomial`` (it records log-probs and entropies too, so the work is the same);
- *HF generate*: ``model.generate(do_sample=True)`` with its default cache, which records nothing.

Medians over ``--repeats`` after one warm-up; ratios are the medians of per-repeat ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache

from benchmarks._common import model_size, positive_int, table_header, table_row
from brace_lightning.models import load_tokenizer
from brace_lightning.models.policy import position_ids_from_attention_mask
from brace_lightning.models.sources import load_actor
from brace_lightning.rollout import EmbeddedEngine
from brace_lightning.rollout.collect import encode_prompts
from brace_lightning.tasks import ArithmeticTask


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and 0/1 mask of ``prompts`` left-padded to one width."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


@torch.inference_mode()
def former_loop(model: nn.Module, prompts: list[list[int]], tokens: int, seed: int) -> None:
    """The replaced decoding loop: concatenated cache and mask, ``torch.multinomial``."""
    generator = torch.Generator().manual_seed(seed)
    input_ids, mask = left_padded(prompts)
    position = position_ids_from_attention_mask(mask)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position, use_cache=True)
    position = position[:, -1:] + 1
    cache: DynamicCache = out.past_key_values
    recorded = []
    for _ in range(tokens):
        log_probs = out.logits[:, -1].float().log_softmax(dim=-1)
        probs = log_probs.exp()
        token = torch.multinomial(probs, 1, generator=generator)
        plogp = torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs))
        recorded.append((log_probs.gather(-1, token), -plogp.sum(dim=-1)))
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
        out = model(
            input_ids=token,
            attention_mask=mask,
            position_ids=position,
            past_key_values=cache,
            use_cache=True,
        )
        position = position + 1


@torch.inference_mode()
def hf_generate(model: nn.Module, prompts: list[list[int]], tokens: int) -> None:
    """Hugging Face sampling with its default cache and logits processors."""
    input_ids, mask = left_padded(prompts)
    model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        pad_token_id=0,
    )


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(hidden: int, layers: int, tokens: int, repeats: int) -> str:
    """One table row for a ``hidden`` x ``layers`` tiny Qwen2."""
    tokenizer = load_tokenizer("tiny-char")
    model = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=hidden, num_layers=layers)
    model.eval()
    prompts = encode_prompts(
        tokenizer, ArithmeticTask().sample(16, torch.Generator().manual_seed(0))
    )
    expanded = [p for p in prompts for _ in range(4)]
    engine = EmbeddedEngine(model, max_new_tokens=tokens, stop_token_ids=[], seed=0)
    rows: dict[str, Callable[[], object]] = {
        "engine": lambda: engine.generate(prompts, num_samples=4),
        "former": lambda: former_loop(model, expanded, tokens, seed=0),
        "hf": lambda: hf_generate(model, expanded, tokens),
    }
    for fn in rows.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            times[name].append(timed(fn))

    def ratio(name: str) -> float:
        return statistics.median(b / a for a, b in zip(times["engine"], times[name], strict=True))

    engine_s = statistics.median(times["engine"])
    cells = [f"{hidden} x {layers}", f"{engine_s:.3f}", f"{len(expanded) * tokens / engine_s:.0f}"]
    cells += [f"{statistics.median(times['former']):.3f}", f"{ratio('former'):.2f}x"]
    cells += [f"{statistics.median(times['hf']):.3f}", f"{ratio('hf'):.2f}x"]
    return table_row(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--sizes", nargs="+", type=model_size, default=[(32, 1), (64, 1), (128, 2)])
    parser.add_argument("--tokens", type=positive_int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"\n64 samples x {args.tokens} tokens per batch, one torch thread, medians of "
        f"{args.repeats} (speed-ups: median of the per-repeat ratios)\n"
    )
    header = ["hidden x layers", "engine s", "engine tokens/s", "former loop s", "engine speed-up"]
    print(table_header([*header, "HF generate s", "vs HF generate"]))
    for hidden, layers in args.sizes:
        print(measure(hidden, layers, args.tokens, args.repeats), flush=True)


if __name__ == "__main__":
    main()
