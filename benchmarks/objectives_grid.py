"""Actor objectives × value targets on the quickstart task at a fixed staleness.

    .venv/bin/python -m benchmarks.objectives_grid [--seeds 0 1] [--steps 15] [--lag 4]

Runs the grid {PPO, decoupled PPO, PPO-EWMA, IcePop, KPop, DIS, ESTR} × {GAE, V-trace, BRACE}
(``configs/objectives/*.yaml`` × ``configs/targets/*.yaml`` on top of ``configs/quickstart.yaml``)
with the engine ``--lag`` versions behind the trainer (``data.max_staleness = lag``), each run an
in-process ``brace_lightning.cli.run([...])`` call with its own TensorBoard folder, and prints
Markdown tables of the final reward (mean of the last ``--last`` rollout steps), a critic metric,
and the fraction of action tokens the objective's rule masked, each as mean ± std over seeds.

Simplification: the quickstart's supervised warm start (``SupervisedWarmStart``) runs once per seed
(with that seed) and its actor and critic weights are loaded at the start of every run of that
seed (:class:`LoadWarmStart`), instead of repeating the same warm start in all 21 runs. Every cell
of a seed therefore starts from the same weights. Seeds also set ``seed_everything``,
``model.seed`` (minibatch order) and ``data.seed`` (prompt draws).

The critic metric is β, the horizon-bin slope of :class:`brace_lightning.metrics.HorizonBeta`,
when the module logs it (a scalar named ``critic/beta…``); otherwise
``critic/explained_variance`` of the critic's values against its targets, and the table says which.
Defaults take about 22 minutes on 2 CPU cores with ``OMP_NUM_THREADS=1`` (measured: ~2 s per
rollout step of the quickstart recipe, 42 runs of 15 steps). With lag 4 and the quickstart's 3
critic warm-up steps the data is fully stale from step 8 on.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from benchmarks._common import (
    CONFIGS,
    QUICKSTART,
    fit_args,
    markdown_table,
    target_config,
    warm_start_once,
)
from brace_lightning.cli import run
from brace_lightning.export import load_exported_critic
from brace_lightning.logs import read_scalars
from brace_lightning.models.policy import load_causal_lm

OBJECTIVES = {
    "ppo": "PPO",
    "decoupled": "decoupled",
    "ewma": "PPO-EWMA",
    "icepop": "IcePop",
    "kpop": "KPop",
    "dis": "DIS",
    "estr": "ESTR",
}
TARGETS = {"gae": "GAE", "vtrace": "V-trace", "brace": "BRACE"}
EXPLAINED_VARIANCE = "critic/explained_variance"

Series = dict[str, list[tuple[int, float]]]


class LoadWarmStart(pl.Callback):
    """Load the actor and critic weights of :func:`warm_start` when fit starts.

    Args:
        folder: the exported folders (``folder/actor``, ``folder/critic``).
    """

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        actor = load_causal_lm(str(self.folder / "actor")).state_dict()
        critic = load_exported_critic(self.folder / "critic").state_dict()
        pl_module.actor.load_state_dict(actor)
        pl_module.critic.load_state_dict(critic)


def warm_start(seed: int, out: Path, steps: int | None) -> Path:
    """Run the quickstart's warm start (no RL step) with ``seed`` once; the folder of the
    warm-started actor and critic (:func:`benchmarks._common.warm_start_once`).

    Args:
        seed: seeds the tiny model's initialisation, the warm start's pairs and batch order.
        out: folder under which the weights are written.
        steps: warm-start optimizer steps; None keeps the quickstart's.
    """
    overrides = [
        f"--trainer.callbacks.init_args.seed={seed}",
        "--trainer.limit_train_batches=0",
        "--trainer.logger=false",
    ]
    if steps is not None:
        overrides.append(f"--trainer.callbacks.init_args.steps={steps}")
    return warm_start_once(
        out / f"warm_start_seed{seed}", fit_args(QUICKSTART, seed=seed, overrides=overrides)
    )


def train(
    objective: str, target: str, seed: int, weights: Path, out: Path, args: argparse.Namespace
) -> Series:
    """One run of the grid from the warm-started weights; its TensorBoard scalars."""
    log_dir = out / f"{objective}-{target}-seed{seed}"
    trainer_args = fit_args(
        QUICKSTART,
        CONFIGS / "objectives" / f"{objective}.yaml",
        target_config(target),
        seed=seed,
        data_seed=seed,
        steps=args.steps,
        callbacks=False,
        log_dir=log_dir,
        overrides=[
            f"--trainer.default_root_dir={log_dir}",
            f"--data.lag={args.lag}",
            f"--data.max_staleness={args.lag}",
        ],
    )
    cli = run(trainer_args, trainer_defaults={"callbacks": [LoadWarmStart(str(weights))]})
    return read_scalars(cli.trainer.logger.log_dir)


def tail_mean(series: list[tuple[int, float]], last: int) -> float:
    """Mean of the values of the last ``last`` steps of a scalar series."""
    values = [value for _, value in sorted(series)[-last:]]
    return sum(values) / len(values)


def critic_metric_of(scalars: Series, requested: str | None) -> str:
    """``requested``, else a logged ``critic/beta…`` scalar, else explained variance."""
    if requested is not None:
        return requested
    betas = sorted(name for name in scalars if name.startswith("critic/beta"))
    return betas[0] if betas else EXPLAINED_VARIANCE


def cell(values: list[float], digits: int = 3) -> str:
    """``mean ± std`` over seeds (sample std; the mean alone for one seed; — for no value)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(title: str, results: dict[tuple[str, str], list[float]], args: argparse.Namespace) -> str:
    """A Markdown table: one row per objective, one column per value target."""
    header = ["objective", *(TARGETS[t] for t in args.targets)]
    rows = [
        [OBJECTIVES[objective], *(cell(results[objective, target]) for target in args.targets)]
        for objective in args.objectives
    ]
    return f"**{title}**\n\n" + markdown_table(header, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="one run per seed")
    parser.add_argument("--steps", type=int, default=15, help="rollout steps per run")
    parser.add_argument("--lag", type=int, default=4, help="data.lag = data.max_staleness")
    parser.add_argument("--last", type=int, default=5, help="final = mean of the last N steps")
    parser.add_argument(
        "--objectives", nargs="+", choices=list(OBJECTIVES), default=list(OBJECTIVES)
    )
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    parser.add_argument(
        "--warm-start-steps", type=int, default=None, help="default: the quickstart's"
    )
    parser.add_argument(
        "--critic-metric",
        default=None,
        help="scalar to report for the critic; default critic/beta… if logged, else "
        "critic/explained_variance",
    )
    parser.add_argument("--out", type=Path, default=None, help="log folder (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.last < 1 or args.lag < 0:
        parser.error("--steps and --last must be >= 1 and --lag >= 0.")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the grid and print the tables."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    out = args.out or Path(tempfile.mkdtemp(prefix="objectives_grid_"))
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rewards: dict[tuple[str, str], list[float]] = {}
    critic: dict[tuple[str, str], list[float]] = {}
    masked: dict[tuple[str, str], list[float]] = {}
    first_rewards: list[float] = []
    metric_names: set[str] = set()
    last = min(args.last, args.steps)
    for seed in args.seeds:
        weights = warm_start(seed, out, args.warm_start_steps)
        for objective in args.objectives:
            for target in args.targets:
                scalars = train(objective, target, seed, weights, out, args)
                metric = critic_metric_of(scalars, args.critic_metric)
                metric_names.add(metric)
                key = objective, target
                rewards.setdefault(key, []).append(tail_mean(scalars["rollout/reward"], last))
                critic.setdefault(key, []).append(tail_mean(scalars[metric], last))
                mask_series = scalars.get("actor/masked_fraction")
                masked.setdefault(key, []).append(
                    math.nan if mask_series is None else tail_mean(mask_series, len(mask_series))
                )
                first_rewards.append(scalars["rollout/reward"][0][1])
    minutes = (time.perf_counter() - start) / 60
    warm = "quickstart's" if args.warm_start_steps is None else str(args.warm_start_steps)
    print(
        f"## Objectives × value targets, quickstart task: lag = max_staleness = {args.lag}, "
        f"{args.steps} rollout steps, seeds {' '.join(map(str, args.seeds))}, {warm} warm-start steps"
    )
    print(f"\n{len(rewards) * len(args.seeds)} runs in {minutes:.1f} min; logs in {out}.")
    print(f"Reward of the warm-started policy (first step, all runs): {cell(first_rewards)}.\n")
    print(
        table(f"Final reward (mean of the last {last} steps; mean ± std over seeds)", rewards, args)
    )
    names = ", ".join(sorted(metric_names))
    note = (
        ""
        if any(n.startswith("critic/beta") for n in metric_names)
        else (" — β (HorizonBeta) is not in the module's logs, so explained variance is reported")
    )
    print()
    print(table(f"Critic: {names} (mean of the last {last} steps){note}", critic, args))
    print()
    print(table("Fraction of action tokens masked by the rule (mean over steps)", masked, args))


if __name__ == "__main__":
    main()
