"""Where does a critic trained on stale data converge? GAE vs V-trace vs BRACE in the exact MDP.

For each horizon T and staleness S this builds the token-level MDP of :mod:`brace_lightning.sim`
(threshold reward, uniform start policy calibrated to 10 % success), takes π = version n and
µ = version n − S of a fixed natural-policy-gradient learning sequence, samples B responses from µ,
fits a tabular critic to each value target until it stops moving, and prints (Markdown):

1. the setting: per-token KL(µ‖π), V^π(s₀), V^µ(s₀), importance-weight statistics;
2. ĝ to V^π and to V^µ (mean |V − V_ref| over the sampled actions) of each converged critic;
3. β, the slope of each target (with its converged critic) on the realized return, by remaining
   horizon, at the largest S (paper Fig. 2b);
4. b = V^π − V^µ on µ's states by position (paper Fig. 2a).

Run (defaults: 45 s on 2 idle CPU cores; 4 min when other jobs shared them, ~1.5 min with
``--threads 1`` then)::

    .venv/bin/python benchmarks/critic_bias.py
    .venv/bin/python benchmarks/critic_bias.py --horizons 256 1024 4096 --staleness 0 4 8 --tokens 2000000
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from benchmarks._common import markdown_table
from brace_lightning.metrics import (
    HorizonBeta,
    ImportanceWeightStats,
    SeparationByPosition,
    ValueBiasGap,
    power_of_two_edges,
)
from brace_lightning.metrics.functional import reward_to_go
from brace_lightning.sim import (
    CountingMDP,
    exact_values,
    fit_critic,
    per_token_kl,
    sample,
    stale_pair,
    state_values,
)
from brace_lightning.targets import BRACE, GAE, ValueTarget, VTrace


def estimators() -> list[tuple[str, ValueTarget]]:
    """The value targets compared, with table labels (BRACE at the paper's ρ̄ = 1.2, c̄ = 1.1)."""
    out: list[tuple[str, ValueTarget]] = [
        ("GAE λ=1", GAE()),
        ("V-trace ρ̄=c̄=1", VTrace()),
    ]
    for k in (0, 10, 20, 100, None):
        out.append((f"BRACE k={'∞' if k is None else k}", BRACE(k=k)))
    for k in (0, 10, 20, 100):
        out.append((f"BRACE k={k}, no MC tail", BRACE(k=k, mc_tail=False)))
    return out


def gap(values: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor) -> float:
    metric = ValueBiasGap()
    metric.update(
        state_values(values, counts),
        state_values(reference, counts),
        torch.ones_like(counts, dtype=torch.bool),
    )
    return float(metric.compute())


def run_horizon(args: argparse.Namespace, horizon: int) -> dict[str, list]:
    mdp = CountingMDP.calibrated(horizon, args.num_actions, success=args.success)
    batch_size = max(64, args.tokens // horizon)
    position_edges = tuple(range(0, horizon, max(1, horizon // 8)))
    horizon_edges = power_of_two_edges(horizon, start=1)
    setting_rows, gap_cells, beta_rows, separation_rows = [], {}, [], []
    for staleness in args.staleness:
        mu, pi = stale_pair(
            mdp,
            version=args.version,
            staleness=staleness,
            step_size=args.step_size,
            noise=args.noise,
            seed=args.seed,
        )
        v_pi, v_mu = exact_values(mdp, pi), exact_values(mdp, mu)
        generator = torch.Generator().manual_seed(args.seed + 1)
        data = sample(mdp, mu, pi, batch_size=batch_size, generator=generator)

        weights = ImportanceWeightStats()
        weights.update(data.target_logprobs, data.behavior_logprobs, data.mask)
        w = weights.compute()
        setting_rows.append(
            [
                str(horizon),
                str(mdp.threshold),
                str(staleness),
                str(batch_size),
                f"{float(per_token_kl(mdp, mu, pi)):.4f}",
                f"{float(v_pi[0, 0]):.3f}",
                f"{float(v_mu[0, 0]):.3f}",
                f"{float(w['ess']):.3f}",
                f"{float(w['clip_fraction_rho']):.3f}",
                f"{float(w['clip_fraction_c']):.3f}",
            ]
        )
        separation = SeparationByPosition(position_edges)
        separation.update(state_values(v_pi - v_mu, data.counts), data.mask)
        separation_rows.append(
            [f"S={staleness}"] + [f"{v:.3f}" for v in separation.compute().value.tolist()]
        )

        realized = reward_to_go(data.rewards, data.mask)
        for label, target in estimators():
            fit = fit_critic(mdp, data, target, tol=args.tol, max_iterations=args.max_iterations)
            to_pi, to_mu = gap(fit.values, v_pi, data.counts), gap(fit.values, v_mu, data.counts)
            mark = "" if fit.converged else "*"
            gap_cells.setdefault(label, []).append(
                f"{to_pi:.3f} / {to_mu:.3f} ({fit.iterations}{mark})"
            )
            if staleness == max(args.staleness):
                returns = target(
                    rewards=data.rewards,
                    values=state_values(fit.values, data.counts),
                    target_logprobs=data.target_logprobs,
                    behavior_logprobs=data.behavior_logprobs,
                    mask=data.mask,
                ).returns
                beta = HorizonBeta(horizon_edges)
                beta.update(returns, realized, data.mask)
                result = beta.compute()
                beta_rows.append(
                    [label]
                    + [
                        f"{v:.2f}" if ok else "–"
                        for v, ok in zip(
                            result.value.tolist(), result.defined.tolist(), strict=True
                        )
                    ]
                )
        print(f"  T={horizon} S={staleness} done", file=sys.stderr, flush=True)
    return {
        "setting": setting_rows,
        "gaps": [[label, *cells] for label, cells in gap_cells.items()],
        "beta": beta_rows,
        "beta_header": ["target"] + [f"h≥{e}" for e in horizon_edges],
        "separation": separation_rows,
        "separation_header": ["staleness"] + [f"t≥{e}" for e in position_edges],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--horizons", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 2, 4, 8])
    parser.add_argument(
        "--tokens", type=int, default=2**19, help="sampled tokens per setting (B = tokens / T)"
    )
    parser.add_argument("--num-actions", type=int, default=4)
    parser.add_argument("--success", type=float, default=0.1, help="uniform policy's success")
    parser.add_argument("--version", type=int, default=8, help="π's version n")
    parser.add_argument("--step-size", type=float, default=0.5, help="NPG step size η")
    parser.add_argument("--noise", type=float, default=0.03, help="per-step logit drift σ")
    parser.add_argument("--tol", type=float, default=1e-3)
    parser.add_argument("--max-iterations", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); use 1 on a busy machine, where OpenMP threads "
        "oversubscribed by other jobs made this 3-5x slower",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    start = time.perf_counter()
    results = {horizon: run_horizon(args, horizon) for horizon in args.horizons}
    elapsed = time.perf_counter() - start

    print("# Critic bias under staleness (exact token-level MDP)\n")
    print("Command: `" + " ".join(["python", "benchmarks/critic_bias.py", *sys.argv[1:]]) + "`\n")
    print(
        f"A={args.num_actions}, uniform start succeeding {args.success:.0%}, π = version "
        f"{args.version} of NPG steps (η={args.step_size}, drift σ={args.noise}), µ = version n − S; "
        f"critic: tabular over (t, c), exact least squares per state, iterated to sup-change < "
        f"{args.tol}.\n"
    )
    print("## Setting\n")
    header = ["T", "K", "S", "B", "KL(µ‖π)/token", "V^π(s₀)", "V^µ(s₀)", "ESS", "w>ρ̄", "w>c̄"]
    print(markdown_table(header, [row for r in results.values() for row in r["setting"]]) + "\n")
    print("## Converged critic: ĝ to V^π / ĝ to V^µ (iterations; * = not converged)\n")
    for horizon, r in results.items():
        print(f"### T = {horizon}\n")
        print(markdown_table(["target"] + [f"S={s}" for s in args.staleness], r["gaps"]) + "\n")
    print(f"## β by remaining horizon h (S = {max(args.staleness)}, each target's own critic)\n")
    for horizon, r in results.items():
        print(f"### T = {horizon}\n")
        print(markdown_table(r["beta_header"], r["beta"]) + "\n")
    print("## b = V^π − V^µ on µ's states, by position t\n")
    for horizon, r in results.items():
        print(f"### T = {horizon}\n")
        print(markdown_table(r["separation_header"], r["separation"]) + "\n")
    print(f"Wall time: {elapsed:.0f} s ({torch.get_num_threads()} threads).")


if __name__ == "__main__":
    main()
