"""Long responses at a real vocabulary: full vs chunked log-probs; padded, budgeted, packed rows.

A Qwen2.5-0.5B-shaped model (hidden 896, 14 heads of 64, 2 KV heads, MLP 4864, V = 151,936, tied
embeddings; random weights from the config, nothing downloaded; ``--layers`` cuts the depth,
``--vocab`` the vocabulary, for smoke runs):

1. One row of T tokens (``--lengths``): median time and peak extra memory of one actor loss
   forward + backward (``−Σ A · log π`` over the row's tokens) with today's full ``[B, T, V]``
   float32 path (``chunk_size=None``) against the chunked path (``chunk_size=--chunk-size``).
2. A minibatch of ``--rows`` responses with lengths drawn log-uniformly from ``--batch-lengths``
   (seeded): tokens/s of one PPO minibatch update's forwards and backwards, the actor loss
   (``−Σ A · log π``) and, unless ``--no-critic``, the critic's squared error (a backbone of the
   same shape with a value head), micro-batch by micro-batch:

   a. ``padded``: rows in arrival order, ``--padded-rows`` per micro-batch padded to the longest,
      full logits (the trainer before token budgets and chunked log-probs), or chunked log-probs
      with ``--padded-logprobs chunked`` (padding alone against packing, where the full logits of
      a padded micro-batch do not fit);
   b. ``one``: the whole minibatch as one micro-batch padded to its longest row, chunked log-probs
      (``BraceModule``'s defaults: no row cap, no budget);
   c. ``budget``: rows sorted by length in micro-batches of at most ``--max-tokens`` padded tokens
      (rows × width), chunked log-probs (``max_tokens_per_micro_batch``);
   d. ``packed``: rows sorted by length in micro-batches of at most ``--max-tokens`` real tokens,
      each run as one packed row attended row by row (``VARLEN_SDPA``), chunked log-probs
      (``pack_sequences=True``, ``models/packing.py``).

   tokens/s counts the real tokens; ratios are against (a) measured in the same process.

3. ``--largest``: the longest single row whose step (as in 1.) runs, per path: a doubling ladder
   of T from ``--ladder-start`` to ``--max-length`` (Qwen2.5-0.5B's 32768 positions), one step per
   rung in a child process whose address space is capped at ``--memory-gib`` (default: the
   memory available when the benchmark starts), stopping at the first rung that fails. A rung
   that does not fit fails in its child with an allocation error; the machine never swaps. With
   ``--device cuda`` the cap is the GPU's memory (its allocator's out-of-memory error).

``--activation-checkpointing`` recomputes every decoder block in the backward pass, in every case
alike (``BraceModule(activation_checkpointing=True)``).

Peak memory is measured in a child process whose allocator returns every tensor to the OS (see
``benchmarks/_common.py``) and whose address space is capped at ``--memory-gib``, as part 3's rungs
(a case that does not fit ends the benchmark with one sentence, before any timed run); ratios
compare runs in the same process. ``--device cuda`` runs the same
on a GPU (peak from the CUDA allocator).

    .venv/bin/python -m benchmarks.long_responses --layers 2 --lengths 1024 4096
    .venv/bin/python -m benchmarks.long_responses --layers 2 --lengths --batch-lengths 64 1024
    .venv/bin/python -m benchmarks.long_responses --lengths --rows 0 --largest --activation-checkpointing
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

import torch

from benchmarks._common import (
    interleaved_median_seconds,
    peak_extra_mib,
    positive_int,
    proc_kib,
    qwen2_config,
    run_mmap_subprocess,
    table_header,
    table_row,
)
from brace_lightning.models.critic import ValueModel
from brace_lightning.models.microbatch import MicroBatch, plan_micro_batches, widen
from brace_lightning.models.packing import (
    packed_token_logprobs,
    packed_values,
    use_varlen_attention,
)
from brace_lightning.models.parallelize import checkpoint_activations
from brace_lightning.models.policy import DEFAULT_CHUNK_SIZE, load_causal_lm, token_logprobs


def response_lengths(rows: int, low: int, high: int, seed: int) -> list[int]:
    """``rows`` lengths drawn log-uniformly from [low, high]."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    return [int(round(math.exp(math.log(low) + float(x) * math.log(high / low)))) for x in u]


def length_mask(lengths: list[int]) -> torch.Tensor:
    """``[rows, max(lengths)]`` bool, True at the first ``lengths[row]`` columns of each row."""
    return torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]


def make_batch(lengths: list[int], vocab: int, device: str) -> tuple[torch.Tensor, ...]:
    """Right-padded rows (prompt-free responses): ids, attention mask, advantages (also used as
    the critic's regression targets)."""
    gen = torch.Generator().manual_seed(1)
    mask = length_mask(lengths)
    ids = torch.randint(2, vocab, mask.shape, generator=gen)
    ids = torch.where(mask, ids, 0)
    adv = torch.randn(mask.shape, generator=gen)
    return ids.to(device), mask.to(device), adv.to(device)


def minibatch_update(
    model: torch.nn.Module,
    critic: ValueModel | None,
    ids: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    plan: list[MicroBatch],
    chunk_size: int | None,
    packed: bool = False,
) -> None:
    """``−Σ A · log π`` (and the critic's ``Σ (V − A)²``) over the minibatch's tokens, forward +
    backward micro-batch by micro-batch, divided by the minibatch's token count as the trainer does;
    ``packed`` runs each micro-batch as one packed row (needs ``chunk_size``)."""
    count = float(mask[:, 1:].sum())
    width = ids.shape[1]
    for micro in plan:
        rows, cols = micro.rows, micro.columns
        sub_ids, sub_mask = ids[rows, cols], mask[rows, cols]
        if packed:
            logprobs, _ = packed_token_logprobs(model, sub_ids, sub_mask, chunk_size=chunk_size)
        else:
            logprobs, _ = token_logprobs(model, sub_ids, sub_mask, chunk_size=chunk_size)
        loss = -(widen(logprobs, cols, width) * adv[rows]).sum() / count
        loss.backward()
        if critic is not None:
            values = (
                packed_values(critic, sub_ids, sub_mask) if packed else critic(sub_ids, sub_mask)
            )
            error = torch.where(sub_mask, values - adv[rows, cols], 0.0)
            (error.square().sum() / count).backward()
    model.zero_grad(set_to_none=True)
    if critic is not None:
        critic.zero_grad(set_to_none=True)


#: Part 2's cases: name → (plan kind, log-probs chunk size from --chunk-size, packed rows).
BATCH_CASES = {
    "batch/padded": ("arrival", False, False),
    "batch/one": ("one", True, False),
    "batch/budget": ("budget", True, False),
    "batch/packed": ("packed", True, True),
}


def batch_plans(args: argparse.Namespace, mask: torch.Tensor) -> dict[str, list[MicroBatch]]:
    """The micro-batches of each kind of plan of part 2."""
    rows = mask.shape[0]
    return {
        # Consecutive rows in arrival order, each micro-batch padded to its longest row.
        "arrival": [
            _window_of(torch.arange(start, min(start + args.padded_rows, rows)), mask)
            for start in range(0, rows, args.padded_rows)
        ],
        "one": plan_micro_batches(mask),
        "budget": plan_micro_batches(mask, max_tokens=args.max_tokens),
        "packed": plan_micro_batches(mask, max_tokens=args.max_tokens, packed=True),
    }


#: Part 2's optional plans (``--plans``); ``padded`` always runs as the baseline.
OPTIONAL_PLANS = ["one", "budget", "packed"]


def cases(
    args: argparse.Namespace, model: torch.nn.Module, critic: ValueModel | None
) -> dict[str, tuple[Callable[[], None], int]]:
    """name → (callable, tokens) of every measured case."""
    vocab = model.config.vocab_size
    out: dict[str, tuple[Callable[[], None], int]] = {}
    for length in args.lengths:
        ids, mask, adv = make_batch([length], vocab, args.device)
        plan = plan_micro_batches(mask)
        for name, size in (("full", None), ("chunked", args.chunk_size)):
            if name not in args.paths:
                continue
            out[f"row/{length}/{name}"] = (
                lambda i=ids, m=mask, a=adv, p=plan, s=size: minibatch_update(
                    model, None, i, m, a, p, s
                ),
                length,
            )
    if args.rows:
        lengths = response_lengths(args.rows, *args.batch_lengths, seed=args.seed)
        ids, mask, adv = make_batch(lengths, vocab, args.device)
        plans = batch_plans(args, mask)
        for name, (kind, chunked, packed) in BATCH_CASES.items():
            if name != "batch/padded" and name.split("/")[1] not in args.plans:
                continue
            if name == "batch/padded":
                chunked = args.padded_logprobs == "chunked"
            out[name] = (
                lambda p=plans[kind], s=args.chunk_size if chunked else None, k=packed: (
                    minibatch_update(model, critic, ids, mask, adv, p, s, k)
                ),
                sum(lengths),
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
    parser.add_argument(
        "--vocab", type=positive_int, default=151_936, help="vocabulary (smaller: smoke runs only)"
    )
    parser.add_argument(
        "--lengths",
        type=positive_int,
        nargs="*",
        default=[1024, 4096, 8192],
        help="single-row lengths of part 1 (none: skip part 1)",
    )
    parser.add_argument("--chunk-size", type=positive_int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--rows", type=int, default=16, help="minibatch rows (0 = skip part 2)")
    parser.add_argument("--batch-lengths", type=positive_int, nargs=2, default=[64, 4096])
    parser.add_argument("--padded-rows", type=positive_int, default=2)
    parser.add_argument(
        "--padded-logprobs",
        choices=PATHS,
        default="full",
        help="log-probs of part 2's padded baseline",
    )
    parser.add_argument("--max-tokens", type=positive_int, default=4096)
    parser.add_argument(
        "--plans",
        nargs="*",
        choices=OPTIONAL_PLANS,
        default=OPTIONAL_PLANS,
        help="part 2's plans beside the padded baseline",
    )
    parser.add_argument(
        "--critic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="part 2 also runs the critic's loss forward + backward",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute every decoder block in the backward pass (both paths alike)",
    )
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument(
        "--largest", action="store_true", help="part 3: the longest row that fits, per path"
    )
    parser.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="address-space cap of every memory-measuring child (default: MemAvailable)",
    )
    parser.add_argument("--ladder-start", type=positive_int, default=4096)
    parser.add_argument("--max-length", type=positive_int, default=32_768)
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=PATHS,
        default=PATHS,
        help="part 1's and part 3's log-prob paths (e.g. one more rung of the chunked ladder)",
    )
    args = parser.parse_args()
    if args.rows < 0:
        parser.error(f"--rows must be >= 0; got {args.rows}")
    if not args.lengths and not args.rows and not args.largest:
        parser.error(
            "--lengths is empty, --rows is 0 and --largest is off; expected something to measure"
        )
    if args.memory_gib is not None and args.memory_gib <= 0:
        parser.error(f"--memory-gib must be > 0; got {args.memory_gib}")
    if args.memory_gib is not None and args.device.startswith("cuda"):
        parser.error(
            f"--memory-gib caps the CPU's address space; got {args.memory_gib} with "
            f"--device {args.device}, whose cap is the GPU's own memory"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    longest = max([*args.lengths, args.batch_lengths[1]])
    config = qwen2_config(layers=args.layers, vocab_size=args.vocab, max_positions=longest + 1)
    model = load_causal_lm(config, seed=0).to(args.device)
    model.train()
    critic = None
    if args.critic and args.rows:
        critic = ValueModel.from_actor(model, seed=1, head_init_std=0.1).train()
    for net in (model, critic):
        if net is not None:
            use_varlen_attention(net)  # packed rows attend row by row, as in the trainer
            if args.activation_checkpointing:
                checkpoint_activations(net)
    measured = cases(args, model, critic)
    if args.memory_child:
        warm_up(model, critic, args)
        print(json.dumps(measure_once(measured, args.device)))
        return
    if args.memory_gib is None and not args.device.startswith("cuda"):
        args.memory_gib = available_memory_gib()  # every memory-measuring child's cap
    if args.largest:
        print_largest_table(args)
    if not measured:
        return
    if args.device.startswith("cuda"):
        memory = {name: peak_extra_mib(fn, args.device) for name, (fn, _) in measured.items()}
    else:
        memory = memory_child(sys.argv[1:], args.memory_gib)["peak_mib"]
    warm_up(model, critic, args)
    seconds = interleaved_median_seconds(
        {name: fn for name, (fn, _) in measured.items()}, repeats=args.repeats, warmup=0
    )
    print(
        f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__}; "
        f"Qwen2.5-0.5B shape, {args.layers} layers, V={args.vocab}, float32; "
        f"chunk={args.chunk_size}; "
        f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}; "
        f"median of {args.repeats} runs taken in turns (after a 16-token warm-up step per path)"
    )
    if args.lengths:
        print()
        header = ["T", "path", "median s", "peak extra MiB", "× full time", "full / chunked peak"]
        print(table_header(header))
    for length in args.lengths:
        full = f"row/{length}/full"
        for path in args.paths:
            name = f"row/{length}/{path}"
            # The ratios need the full path measured beside it (``--paths`` may leave it out).
            ratios = (
                [f"{seconds[name] / seconds[full]:.2f}", f"{memory[full] / memory[name]:.2f}"]
                if full in seconds
                else ["-", "-"]
            )
            print(table_row([length, path, f"{seconds[name]:.2f}", f"{memory[name]:.0f}", *ratios]))
    if args.rows:
        print_batch_table(args, seconds, memory)


#: Part 1's paths: today's full ``[B, T, V]`` log-softmax and the chunked head.
PATHS = ["full", "chunked"]


def warm_up(model: torch.nn.Module, critic: ValueModel | None, args: argparse.Namespace) -> None:
    """One unmeasured 16-token step on each path (full, chunked, packed), so that one-time
    allocations (thread pools, autograd's engine) fall on no measured case, at no cost next to the
    cases themselves; the timed runs and the memory child both start after it."""
    ids, mask, adv = make_batch([16], model.config.vocab_size, args.device)
    plan = plan_micro_batches(mask)
    for size, packed in ((None, False), (args.chunk_size, False), (args.chunk_size, True)):
        minibatch_update(model, critic, ids, mask, adv, plan, size, packed)


def measure_once(
    measured: dict[str, tuple[Callable[[], None], int]], device: str
) -> dict[str, object]:
    """The memory child's report: resident MiB with the model built (``baseline_mib``; on CUDA the
    allocated MiB), then per case its peak extra MiB and the seconds of that one run (slowed by the
    mmap threshold on CPU)."""
    baseline = (
        torch.cuda.memory_allocated(device) / 2**20 if device.startswith("cuda") else resident_mib()
    )
    peaks: dict[str, float | None] = {}
    seconds: dict[str, float] = {}
    for name, (fn, _) in measured.items():
        start = time.perf_counter()
        peaks[name] = peak_extra_mib(fn, device)
        seconds[name] = time.perf_counter() - start
    return {"baseline_mib": baseline, "peak_mib": peaks, "seconds": seconds}


def memory_child(argv: list[str], memory_gib: float) -> dict:
    """:func:`measure_once` of this script run with ``argv`` in a child process whose allocator
    returns every tensor to the OS and whose address space is capped at ``memory_gib`` (as each
    rung of part 3), so that a case too large for the machine ends the benchmark with one sentence
    instead of meeting the OOM killer."""
    done = run_mmap_subprocess(
        "benchmarks.long_responses", [*argv, "--memory-child"], max_bytes=int(memory_gib * 2**30)
    )
    if done.returncode != 0:
        raise SystemExit(
            f"the memory-measuring child failed within {memory_gib:.1f} GiB of address space "
            f"({failure(done.stderr)}); expected every case to fit: measure fewer or shorter "
            "rows, or raise --memory-gib"
        )
    return json.loads(done.stdout)


def resident_mib() -> float:
    """This process's resident memory (``VmRSS``) in MiB."""
    return proc_kib("VmRSS") / 1024


def available_memory_gib() -> float:
    """The memory available for new work on this machine (``MemAvailable``) in GiB."""
    return proc_kib("MemAvailable", "/proc/meminfo") / 2**20


def ladder(start: int, stop: int) -> list[int]:
    """``start``, ``2·start``, ... below ``stop``, then ``stop`` itself."""
    rungs = []
    while start < stop:
        rungs.append(start)
        start *= 2
    return [*rungs, stop]


def failure(stderr: str) -> str:
    """Why a memory-measuring child (a rung of part 3, or parts 1 and 2's) failed, in a few words:
    "out of memory" for an allocation error, else the last line of its error output (cut to 80
    characters)."""
    if "can't allocate memory" in stderr or "MemoryError" in stderr:
        return "out of memory"
    lines = [line for line in stderr.splitlines() if line.strip()]
    return (lines[-1] if lines else "no error output")[:80].replace("|", "/")


def print_largest_table(args: argparse.Namespace) -> None:
    """Part 3: per path, the longest rung of :func:`ladder` whose step ran within
    ``--memory-gib``, and the first that did not. The model's own arguments (depth, vocabulary,
    chunk, checkpointing, threads) are passed to every child."""
    model_args = [
        f"--layers={args.layers}",
        f"--vocab={args.vocab}",
        f"--chunk-size={args.chunk_size}",
        f"--device={args.device}",
        "--rows=0",
        *(["--activation-checkpointing"] if args.activation_checkpointing else []),
        *([f"--threads={args.threads}"] if args.threads else []),
    ]
    if args.device.startswith("cuda"):
        # The GPU's allocator fails a step that does not fit; CUDA itself maps far more address
        # space than the machine has, so no RLIMIT_AS cap.
        max_bytes, within, before = None, "the GPU's memory", "allocated before MiB"
    else:
        max_bytes = int(args.memory_gib * 2**30)
        within, before = f"{args.memory_gib:.1f} GiB of address space", "resident before MiB"
    print()
    print(
        f"Largest single row within {within}: one actor loss "
        f"forward + backward, {args.layers} layers, V={args.vocab}, {args.device}, "
        f"chunk={args.chunk_size}, activation checkpointing "
        f"{'on' if args.activation_checkpointing else 'off'}; one run per length (in the "
        "memory-measuring child, slower than timed runs)"
    )
    print()
    header = ["path", "largest T that ran", "its peak extra MiB", before, "its s"]
    print(table_header([*header, "first T that did not"]))
    for path in args.paths:
        fitted, failed = ["-", "-", "-", "-"], "-"
        for length in ladder(args.ladder_start, args.max_length):
            done = run_mmap_subprocess(
                "benchmarks.long_responses",
                [*model_args, "--paths", path, "--lengths", str(length), "--memory-child"],
                max_bytes=max_bytes,
            )
            if done.returncode != 0:
                failed = f"{length} ({failure(done.stderr)})"
                break
            run = json.loads(done.stdout)
            name = f"row/{length}/{path}"
            fitted = [
                str(length),
                f"{run['peak_mib'][name]:.0f}",
                f"{run['baseline_mib']:.0f}",
                f"{run['seconds'][name]:.1f}",
            ]
        print(table_row([path, *fitted, failed]))


def print_batch_table(
    args: argparse.Namespace, seconds: dict[str, float], memory: dict[str, float | None]
) -> None:
    """Part 2's table: one line per case of :data:`BATCH_CASES`."""
    lengths = response_lengths(args.rows, *args.batch_lengths, seed=args.seed)
    mask = length_mask(lengths)
    plans = batch_plans(args, mask)
    what = "actor + critic" if args.critic else "actor"
    print()
    print(
        f"{args.rows} responses, log-uniform {args.batch_lengths[0]}..{args.batch_lengths[1]} "
        f"(seed {args.seed}): {sum(lengths)} tokens, longest {max(lengths)}; {what} loss "
        "forward + backward"
    )
    print()
    header = ["micro-batches", "forwards", "tokens computed", "median s", "tokens/s", "× padded"]
    print(table_header([*header, "peak extra MiB"]))
    labels = {
        "batch/padded": (
            f"{args.padded_rows} rows in arrival order, padded, "
            + ("full logits" if args.padded_logprobs == "full" else "chunked")
        ),
        "batch/one": "all rows in one micro-batch, padded, chunked",
        "batch/budget": f"sorted, {args.max_tokens} padded-token budget, chunked",
        "batch/packed": f"sorted, {args.max_tokens} real-token budget, packed, chunked",
    }
    base = seconds["batch/padded"]
    for name, label in labels.items():
        if name not in seconds:
            continue
        kind, _, packed = BATCH_CASES[name]
        plan = plans[kind]
        computed = sum(int(mask[m.rows].sum()) if packed else m.tokens for m in plan)
        peak = memory[name]
        cells = [label, len(plan), computed, f"{seconds[name]:.2f}"]
        cells += [f"{sum(lengths) / seconds[name]:.0f}", f"{base / seconds[name]:.2f}"]
        print(table_row([*cells, "n/a" if peak is None else f"{peak:.0f}"]))


if __name__ == "__main__":
    main()
