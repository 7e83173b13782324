"""Speed and memory of the value-target kernels against a Python loop over time and TorchRL.

    python benchmarks/value_targets.py [--device cpu|cuda] [--threads 1] [--repeats 7]

Prints a Markdown table: median time per call of our ``gae``, ``vtrace`` and ``brace`` (k = 100),
of the common implementation style (a Python loop over time steps, vectorised over the batch),
and of TorchRL's ``generalized_advantage_estimate`` / ``vtrace_advantage_estimate`` when the
``bench`` extra is installed, with ratios against our kernels measured in the same process, and
the peak extra memory of each call.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings

import torch

from benchmarks._common import (
    in_mmap_subprocess,
    median_seconds,
    peak_extra_mib,
    table_header,
    table_row,
)
from brace_lightning.targets.functional import brace, gae, vtrace

SHAPES = [(64, 1024), (16, 8192), (4, 32768)]


def make_inputs(B: int, T: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A rollout-shaped batch: 10% prompt on the left, ragged right padding, terminal reward."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T - T // 10 + 1, (B,), generator=g)
    cols = torch.arange(T)
    mask = (cols >= T // 10) & (cols < (T // 10 + lengths).unsqueeze(1))
    last = T // 10 + lengths - 1
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), last] = (torch.rand(B, generator=g) > 0.5).float()
    values = torch.rand(B, T, generator=g)
    target = -torch.rand(B, T, generator=g) * 2
    behavior = target + torch.randn(B, T, generator=g) * 0.3
    out = dict(rewards=rewards, values=values, target=target, behavior=behavior, mask=mask)
    return {k: v.to(device) for k, v in out.items()}


def loop_gae(x: dict[str, torch.Tensor], gamma: float = 1.0, lmbda: float = 1.0) -> torch.Tensor:
    """The usual implementation (TRL, OpenRLHF style): a reversed Python loop over columns."""
    rewards, values, mask = x["rewards"], x["values"], x["mask"]
    T = rewards.shape[1]
    last = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    out = torch.zeros_like(values)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = torch.where(m, delta + gamma * lmbda * last, last)
        next_value = torch.where(m, values[:, t], next_value)
        out[:, t] = torch.where(m, last, 0.0)
    return out


def loop_brace(x: dict[str, torch.Tensor], k: int = 100) -> torch.Tensor:
    """BRACE written the usual way: a Python loop over start positions within a window (k steps)."""
    rewards, values, mask = x["rewards"], x["values"], x["mask"]
    log_w = x["target"] - x["behavior"]
    rho = log_w.clamp(max=math.log(1.2)).exp()
    c = log_w.clamp(max=math.log(1.1)).exp()
    B, T = rewards.shape
    next_values = torch.cat([values[:, 1:], torch.zeros(B, 1, device=values.device)], dim=1)
    next_values = torch.where(
        torch.cat([mask[:, 1:], torch.zeros(B, 1, dtype=torch.bool, device=mask.device)], 1),
        next_values,
        0.0,
    )
    delta = torch.where(mask, rewards + next_values - values, 0.0)
    return_to_go = torch.where(mask, rewards, 0.0).flip(1).cumsum(1).flip(1)
    target = values.clone()
    weight = torch.ones_like(values)
    for i in range(k):  # window offset i: add weight · ρδ at s + i
        shifted = torch.nn.functional.pad((rho * delta)[:, i:], (0, i))
        target += weight * shifted
        weight = weight * torch.nn.functional.pad(c[:, i:], (0, i), value=1.0)
    tail = torch.nn.functional.pad(torch.where(mask, return_to_go - values, 0.0)[:, k:], (0, k))
    return torch.where(mask, target + weight * tail, 0.0)


def torchrl_fns(x: dict[str, torch.Tensor]):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchrl.objectives.value.functional import (
                generalized_advantage_estimate,
                vtrace_advantage_estimate,
            )
    except ImportError:
        return None, None
    # TorchRL's layout: [B, T, 1], time_dim=-2, done/terminated at each row's last action.
    values = x["values"].unsqueeze(-1)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    rewards = x["rewards"].unsqueeze(-1)
    mask = x["mask"]
    done = (mask & ~torch.nn.functional.pad(mask[:, 1:], (0, 1))).unsqueeze(-1)
    log_pi, log_mu = x["target"].unsqueeze(-1), x["behavior"].unsqueeze(-1)

    def rl_gae():
        return generalized_advantage_estimate(1.0, 1.0, values, next_values, rewards, done, done)

    def rl_vtrace():
        return vtrace_advantage_estimate(
            1.0,
            log_pi,
            log_mu,
            values,
            next_values,
            rewards,
            done,
            done,
            rho_thresh=1.0,
            c_thresh=1.0,
        )

    return rl_gae, rl_vtrace


def make_candidates(x: dict[str, torch.Tensor], repeats: int, loop_repeats: int) -> list:
    """(name, zero-argument callable, repeats) for every method measured on batch ``x``."""
    r, v, t, b, m = x["rewards"], x["values"], x["target"], x["behavior"], x["mask"]
    candidates = [
        ("gae (ours)", lambda: gae(r, v, m), repeats),
        ("vtrace (ours)", lambda: vtrace(r, v, t, b, m), repeats),
        ("brace k=100 (ours)", lambda: brace(r, v, t, b, m, k=100), repeats),
        (
            "brace k=100, log_budget=1 (ours)",
            lambda: brace(r, v, t, b, m, k=100, log_budget=1.0),
            repeats,
        ),
        ("gae, Python loop over time", lambda: loop_gae(x), loop_repeats),
        ("brace, Python loop over window", lambda: loop_brace(x), loop_repeats),
    ]
    rl_gae, rl_vtrace = torchrl_fns(x)
    if rl_gae is not None:
        candidates += [
            ("TorchRL generalized_advantage_estimate", rl_gae, loop_repeats),
            ("TorchRL vtrace_advantage_estimate", rl_vtrace, loop_repeats),
        ]
    return candidates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--loop-repeats", type=int, default=3)
    parser.add_argument("--memory-only", action="store_true", help="print peak memory as JSON")
    parser.add_argument("--shapes", default=",".join(f"{b}x{t}" for b, t in SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.memory_only:
        with torch.no_grad():
            memory = {
                f"{B}x{T}/{name}": peak_extra_mib(fn, args.device)
                for B, T in shapes
                for name, fn, _ in make_candidates(make_inputs(B, T, args.device), 1, 1)
            }
        print(json.dumps(memory))
        return
    memory: dict[str, float | None] = {}
    if args.device == "cpu":
        child = ["--memory-only", "--shapes", args.shapes, "--threads", str(args.threads)]
        memory = json.loads(in_mmap_subprocess("benchmarks.value_targets", child))

    print(
        f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__}; "
        f"median of {args.repeats} runs (loops: {args.loop_repeats}), float32, k=100\n"
    )
    header = ["B x T", "method", "median ms", "× our gae", "× our brace", "peak extra MiB"]
    print(table_header(header))
    for B, T in shapes:
        x = make_inputs(B, T, args.device)
        candidates = make_candidates(x, args.repeats, args.loop_repeats)
        results = []
        with torch.no_grad():
            for name, fn, repeats in candidates:
                seconds = median_seconds(fn, repeats=repeats)
                if args.device != "cpu":
                    memory[f"{B}x{T}/{name}"] = peak_extra_mib(fn, args.device)
                results.append((name, seconds, memory[f"{B}x{T}/{name}"]))
        ours = {name: s for name, s, _ in results}
        for name, seconds, peak in results:
            mem = "n/a" if peak is None else f"{peak:.1f}"
            cells = [f"{B} x {T}", name, f"{seconds * 1e3:.2f}"]
            cells += [
                f"{seconds / ours['gae (ours)']:.2f}",
                f"{seconds / ours['brace k=100 (ours)']:.2f}",
            ]
            print(table_row([*cells, mem]))
    # Correctness of the loop baseline, so the comparison is like for like.
    x = make_inputs(8, 512, args.device)
    ref = brace(x["rewards"], x["values"], x["target"], x["behavior"], x["mask"], k=100).returns
    assert torch.allclose(loop_brace(x), ref, atol=1e-3), "loop_brace disagrees with brace"
    assert torch.allclose(
        loop_gae(x), gae(x["rewards"], x["values"], x["mask"]).advantages, atol=1e-3
    )


if __name__ == "__main__":
    main()
