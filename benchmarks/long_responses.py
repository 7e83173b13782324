"""Long responses at a real vocabulary: full-logits vs chunked log-probs, padded vs token-budget.

A Qwen2.5-0.5B-shaped model (hidden 896, 14 heads of 64, 2 KV heads, MLP 4864, V = 151,936, tied
embeddings; random weights from the config, nothing downloaded; ``--layers`` cuts the depth):

1. One row of T tokens (``--lengths``): median time and peak extra memory of one actor loss
   forward + backward (``−Σ A · log π`` over the row's tokens) with today's full ``[B, T, V]``
   float32 path (``chunk_size=None``) against the chunked path (``chunk_size=--chunk-size``).
2. A minibatch of ``--rows`` responses with lengths drawn log-uniformly from ``--batch-lengths``
   (seeded): tokens/s of the actor loss forward + backward over the whole minibatch, (a) rows in
   arrival order, ``--padded-rows`` per micro-batch padded to the longest, full logits (today's
   trainer), against (b) rows sorted by length in ``--max-tokens`` token-budget micro-batches with
   chunked log-probs (``models/microbatch.py``).

Peak memory is measured in a child process whose allocator returns every tensor to the OS (see
``benchmarks/_timing.py``); ratios compare runs in the same process. ``--device cuda`` runs the same
on a GPU (peak from the CUDA allocator).

    .venv/bin/python -m benchmarks.long_responses --layers 2 --lengths 1024 4096
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable

import torch
from transformers import Qwen2Config

from benchmarks._timing import in_mmap_subprocess, median_seconds, peak_extra_mib, positive_int
from brace_lightning.models.microbatch import MicroBatch, plan_micro_batches, widen
from brace_lightning.models.policy import load_causal_lm, token_logprobs


def qwen25_05b_config(layers: int, max_positions: int) -> Qwen2Config:
    """The shape of Qwen2.5-0.5B with ``layers`` decoder layers."""
    return Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    )


def response_lengths(rows: int, low: int, high: int, seed: int) -> list[int]:
    """``rows`` lengths drawn log-uniformly from [low, high]."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    return [int(round(math.exp(math.log(low) + float(x) * math.log(high / low)))) for x in u]


def make_batch(lengths: list[int], vocab: int, device: str) -> tuple[torch.Tensor, ...]:
    """Right-padded rows (prompt-free responses): ids, attention mask, advantages."""
    gen = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.randint(2, vocab, (len(lengths), width), generator=gen)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, length in enumerate(lengths):
        mask[row, :length] = True
    ids = torch.where(mask, ids, 0)
    adv = torch.randn(len(lengths), width, generator=gen)
    return ids.to(device), mask.to(device), adv.to(device)


def actor_loss_backward(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    plan: list[MicroBatch],
    chunk_size: int | None,
) -> None:
    """``−Σ A · log π`` over the minibatch's tokens, forward + backward micro-batch by micro-batch
    (divided by the minibatch's token count, as the trainer does)."""
    count = float(mask[:, 1:].sum())
    width = ids.shape[1]
    for micro in plan:
        rows, cols = micro.rows, micro.columns
        logprobs, _ = token_logprobs(
            model, ids[rows, cols], mask[rows, cols], chunk_size=chunk_size
        )
        loss = -(widen(logprobs, cols, width) * adv[rows]).sum() / count
        loss.backward()
    model.zero_grad(set_to_none=True)


def cases(
    args: argparse.Namespace, model: torch.nn.Module
) -> dict[str, tuple[Callable[[], None], int]]:
    """name → (callable, tokens) of every measured case."""
    vocab = model.config.vocab_size
    out: dict[str, tuple[Callable[[], None], int]] = {}
    for length in args.lengths:
        ids, mask, adv = make_batch([length], vocab, args.device)
        plan = plan_micro_batches(mask)
        for name, size in (("full", None), ("chunked", args.chunk_size)):
            out[f"row/{length}/{name}"] = (
                lambda i=ids, m=mask, a=adv, p=plan, s=size: actor_loss_backward(
                    model, i, m, a, p, s
                ),
                length,
            )
    if args.rows:
        lengths = response_lengths(args.rows, *args.batch_lengths, seed=args.seed)
        ids, mask, adv = make_batch(lengths, vocab, args.device)
        tokens = sum(lengths)
        # Today: consecutive rows in arrival order, each micro-batch padded to its longest row.
        padded = [
            _window_of(torch.arange(start, min(start + args.padded_rows, args.rows)), mask)
            for start in range(0, args.rows, args.padded_rows)
        ]
        budget = plan_micro_batches(mask, max_tokens=args.max_tokens)
        out["batch/padded"] = (
            lambda: actor_loss_backward(model, ids, mask, adv, padded, None),
            tokens,
        )
        out["batch/budget"] = (
            lambda: actor_loss_backward(model, ids, mask, adv, budget, args.chunk_size),
            tokens,
        )
    return out


def _window_of(rows: torch.Tensor, mask: torch.Tensor) -> MicroBatch:
    """Rows as one micro-batch cut to the columns holding their real tokens."""
    rows = rows.to(mask.device)
    real = mask[rows].any(0).nonzero().flatten()
    return MicroBatch(rows, slice(int(real[0]), int(real[-1]) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=positive_int, default=24)
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--chunk-size", type=positive_int, default=1024)
    parser.add_argument("--rows", type=int, default=16, help="minibatch rows (0 = skip part 2)")
    parser.add_argument("--batch-lengths", type=positive_int, nargs=2, default=[64, 4096])
    parser.add_argument("--padded-rows", type=positive_int, default=2)
    parser.add_argument("--max-tokens", type=positive_int, default=4096)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rows < 0:
        parser.error(f"--rows must be >= 0; got {args.rows}")
    if args.threads:
        torch.set_num_threads(args.threads)
    longest = max([*args.lengths, args.batch_lengths[1]])
    model = load_causal_lm(qwen25_05b_config(args.layers, longest + 1), seed=0).to(args.device)
    model.train()
    measured = cases(args, model)
    if args.memory_child:
        print(
            json.dumps(
                {name: peak_extra_mib(fn, args.device) for name, (fn, _) in measured.items()}
            )
        )
        return
    if args.device.startswith("cuda"):
        memory = {name: peak_extra_mib(fn, args.device) for name, (fn, _) in measured.items()}
    else:
        child = [*sys.argv[1:], "--memory-child"]
        memory = json.loads(in_mmap_subprocess("benchmarks.long_responses", child))
    seconds = {
        name: median_seconds(fn, repeats=args.repeats, warmup=1)
        for name, (fn, _) in measured.items()
    }
    print(
        f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__}; "
        f"Qwen2.5-0.5B shape, {args.layers} layers, V=151936, float32; chunk={args.chunk_size}; "
        f"median of {args.repeats} runs (after 1 warm-up)"
    )
    print()
    print("| T | path | median s | peak extra MiB | × full time | full / chunked peak |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        full, chunked = f"row/{length}/full", f"row/{length}/chunked"
        for name in (full, chunked):
            print(
                f"| {length} | {name.rsplit('/', 1)[1]} | {seconds[name]:.2f} | "
                f"{memory[name]:.0f} | {seconds[name] / seconds[full]:.2f} | "
                f"{memory[full] / memory[name]:.2f} |"
            )
    if args.rows:
        lengths = response_lengths(args.rows, *args.batch_lengths, seed=args.seed)
        print()
        print(
            f"{args.rows} responses, log-uniform {args.batch_lengths[0]}..{args.batch_lengths[1]} "
            f"(seed {args.seed}): {sum(lengths)} tokens, longest {max(lengths)}"
        )
        print()
        print("| micro-batches | median s | tokens/s | × padded | peak extra MiB |")
        print("|---|---|---|---|---|")
        labels = {
            "batch/padded": f"{args.padded_rows} rows in arrival order, padded, full logits",
            "batch/budget": f"sorted, {args.max_tokens}-token budget, chunked",
        }
        base = seconds["batch/padded"]
        for name, label in labels.items():
            tokens = measured[name][1]
            print(
                f"| {label} | {seconds[name]:.2f} | {tokens / seconds[name]:.0f} | "
                f"{base / seconds[name]:.2f} | {memory[name]:.0f} |"
            )


if __name__ == "__main__":
    main()
