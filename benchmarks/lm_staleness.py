"""Staleness grid on a language model: fixed lag S × value target × seed, then paired aggregation.

Each cell is one ``brace-lightning fit`` of a recipe (default ``configs/evidence/long_count.yaml``)
with ``--seed_everything N``, ``--data.init_args.lag S`` and one value target. The recipe's
``SupervisedWarmStart`` runs once (:func:`warm_start`, into ``OUT/warm_start``) and every cell starts
from that actor; the model, prompt and engine seeds are set to N, so seeds differ in the critic's
value head, the prompts, the sampling noise and the minibatch order, not in the warm start. Every
target runs with the recipe's hyperparameters; only the target class differs:

- ``gae``: ``configs/targets/gae.yaml`` (λ = 1)
- ``vtrace``: ``configs/targets/vtrace.yaml`` (ρ̄ = c̄ = 1)
- ``brace``: ``configs/targets/brace.yaml`` (k = 100, ρ̄ = 1.2, c̄ = 1.1, Monte-Carlo tail)
- ``brace_notail``: the same with ``mc_tail: false`` (``configs/targets/brace_notail.yaml``)
- ``grpo``, ``grpo_is``, ``grpo_opob``, ``grpo_opob_logits`` (named in ``--targets``): critic-free
  GRPO with the group mean, with the importance-weighted group baseline and with VCPO's off-policy
  optimal baseline, exact or with the forward-only norm (``configs/targets/grpo.yaml``,
  ``grpo_is.yaml``, ``grpo_opob.yaml``, ``grpo_opob_logits.yaml``)

A cell writes its TensorBoard events under ``OUT/cells/lag<S>/<target>/seed<N>/`` and, when the run
exits cleanly, a ``done.json`` marker; cells with a marker are skipped, so a rerun resumes. Cells run
one at a time by default (``--workers``), each with one torch thread (``OMP_NUM_THREADS=1``).
``--launcher submitit`` sends the warm start and then every cell as one job each through submitit
(SLURM where ``sbatch`` exists, else local processes; ``--cluster local`` forces those), with the
executor's parameters from ``--job KEY=VALUE`` (e.g. ``slurm_partition=cpu timeout_min=60
cpus_per_task=1``); its logs go to ``OUT/submitit/``. The cells and markers are the same either way.

Aggregation, per (S, target) over seeds: the first-, final- and worst-window means of
``rollout/reward`` (higher is better), the last ``val/reward``, the last ``val/value_mse_mc`` (lower
is better; the critic's mean (V − G)² on fresh on-policy rollouts, a proper score) and the last
``val/value_abs_error_mc`` (mean |V − G|, not a proper score against 0/1 returns: runs logged
before 2026-12-06 have only this one, as ``val/value_gap_mc``), the final response length
and the run's mean KL(π‖µ) per token (how far the policy moved from the stale behaviour), each with
its
mean and 95% Student-t interval (``brace_lightning.sweep.interval``), and its difference to GAE at
the same S paired seed by seed; a difference whose interval covers 0 is a tie. Writes
``OUT/summary.md`` (markdown table) and ``OUT/curves.png`` (reward and value gap vs step, one panel
per S, mean with a shaded interval)::

    .venv/bin/python -m benchmarks.lm_staleness --out runs/lm_staleness --seeds 0 1 2 \\
        --lags 0 8 4 --steps 200 --every 20 --workers 1
"""

from __future__ import annotations

import argparse
import functools
import math
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import (
    CONFIGS,
    REPO,
    cli_command,
    fit_args,
    markdown_table,
    subprocess_env,
    target_config,
    warm_start_once,
)
from brace_lightning.sweep import interval, paired_difference, write_marker

RECIPE = CONFIGS / "evidence" / "long_count.yaml"
REFERENCE = "gae"

#: Target name -> CLI arguments that select it (every other option comes from the recipe).
TARGETS: dict[str, list[str]] = {
    name: ["--config", str(target_config(name))]
    for name in ("gae", "vtrace", "brace", "brace_notail")
}
# Ablations of the advantage's ρ factor (V-trace has it, GAE and BRACE do not); not run unless
# named in --targets.
TARGETS |= {name: ["--config", str(target_config(name))] for name in ("brace_rho", "vtrace_norho")}
# Critic-free arms (no critic, so no val/value_gap_mc): GRPO with µ's plain group mean, with the
# importance-weighted group baseline and with VCPO's optimal baseline (docs/value_targets.md); not
# run unless named in --targets.
CRITIC_FREE = ("grpo", "grpo_is", "grpo_opob", "grpo_opob_logits")
TARGETS |= {name: ["--config", str(target_config(name))] for name in CRITIC_FREE}
#: The issue's four targets: the default grid.
DEFAULT_TARGETS = ["gae", "vtrace", "brace", "brace_notail"]

#: Table columns: (name, tag, window, higher is better; None: neither). Windows are those of
#: :func:`score`: "first"/"final" the mean of the first or last ``--window`` values of the series,
#: "worst" the lowest mean of its consecutive ``--window``-step windows (the deepest dip), "mean"
#: the whole run's mean, "last" its last value (validation).
METRICS = (
    ("reward, first window", "rollout/reward", "first", True),
    ("reward, final window", "rollout/reward", "final", True),
    # Post hoc: added after the lag-4 runs of results_lm.md had been seen (issue 31).
    ("reward, worst window (post hoc)", "rollout/reward", "worst", True),
    ("val/reward, last", "val/reward", "last", True),
    ("val/value_mse_mc, last", "val/value_mse_mc", "last", False),
    ("val/value_abs_error_mc, last", "val/value_abs_error_mc", "last", False),
    ("response length, final window", "rollout/response_length", "final", None),
    ("KL(π‖µ) per token, run mean", "kl/pi_mu", "mean", None),
)


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    lag: int
    target: str
    seed: int

    def __str__(self) -> str:
        return f"lag{self.lag}/{self.target}/seed{self.seed}"

    def folder(self, out: Path) -> Path:
        """Where the cell writes its events and its ``done.json`` marker."""
        return out / "cells" / f"lag{self.lag}" / self.target / f"seed{self.seed}"


def grid(lags: Sequence[int], targets: Sequence[str], seeds: Sequence[int]) -> list[Cell]:
    """Cells in run order: seed by seed, then lag, then target.

    Seeds outermost, so a grid stopped early holds whole seeds (every lag and target); run a
    smaller ``--lags`` first to give those lags priority (finished cells are skipped later).
    """
    return [Cell(lag, target, seed) for seed in seeds for lag in lags for target in targets]


def command(
    cell: Cell, out: Path, *, steps: int, every: int, recipe: Path, extra: Sequence[str]
) -> list[str]:
    """The ``brace-lightning fit`` command line of ``cell``: ``steps`` rollout steps as
    ``steps // every`` epochs of ``every`` steps (validation at each epoch end), from the shared
    warm-started actor (:func:`warm_start`), so the recipe's warm-start callback is left out."""
    args = fit_args(
        recipe,
        target_config(cell.target),  # the arguments of TARGETS[cell.target]
        seed=cell.seed,
        data_seed=cell.seed,
        callbacks=False,
        log_dir=cell.folder(out),
        run_name="tb",
        overrides=[
            f"--model.actor={warm_actor(out)}",
            *lag_overrides(lag=cell.lag, seed=cell.seed, steps=steps, every=every),
            *extra,
        ],
    )
    return cli_command(args)


def lag_overrides(*, lag: int, seed: int, steps: int, every: int) -> list[str]:
    """The overrides of every staleness run (this grid's, the map's, the shadow recordings'): the
    engine's sampling ``seed``, the fixed ``lag`` and the same staleness bound, and ``steps``
    rollout steps as ``steps // every`` epochs of ``every`` (validation after each)."""
    return [
        f"--data.init_args.engine.init_args.seed={seed}",
        f"--data.init_args.lag={lag}",
        f"--data.init_args.max_staleness={lag}",
        f"--trainer.max_epochs={steps // every}",
        f"--trainer.limit_train_batches={every}",
    ]


def warm_actor(out: Path) -> Path:
    """The folder of the shared warm-started actor (a Hugging Face folder with its tokenizer)."""
    return out / "warm_start" / "actor"


def warm_start(out: Path, recipe: Path, extra: Sequence[str]) -> None:
    """Run the recipe's ``SupervisedWarmStart`` once and export the actor for every cell
    (:func:`benchmarks._common.warm_start_once`).

    The export comes from a one-step ``fit`` whose single step is a critic warm-up step
    (``critic_warmup_steps=1``), so the exported actor is exactly the warm-started one.
    """
    overrides = [
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=1",
        "--model.critic_warmup_steps=1",
        "--data.init_args.val_batches=0",
        "--trainer.logger=false",
        *extra,
    ]
    warm_start_once(out / "warm_start", fit_args(recipe, overrides=overrides))


def run_cell(
    cell: Cell, out: Path, *, steps: int, every: int, recipe: Path, extra: Sequence[str]
) -> str:
    """Run ``cell`` unless its marker exists; returns ``"skipped"``, ``"done"`` or ``"failed"``.

    ``steps`` rollout steps run as ``steps // every`` epochs of ``every`` steps (validation at
    each epoch end). A failed run leaves its ``stderr.txt`` and no marker, so a rerun retries it
    (after deleting its partial events).
    """
    args = command(cell, out, steps=steps, every=every, recipe=recipe, extra=extra)
    return run_marked(cell.folder(out), args, {"cell": cell.__dict__})


def run_marked(folder: Path, args: list[str], record: dict[str, Any]) -> str:
    """Run the command ``args`` (:func:`benchmarks._common.cli_command`) in ``folder`` unless its ``done.json`` marker
    exists (the grid runners' one resume rule): ``"skipped"``, ``"done"`` or ``"failed"``. A failed
    run leaves its ``stderr.txt`` and no marker; its partial events are deleted by the retry."""
    marker = folder / "done.json"
    if marker.exists():
        return "skipped"
    shutil.rmtree(folder / "tb", ignore_errors=True)  # events of an earlier, failed try
    folder.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with (folder / "stdout.txt").open("w") as stdout, (folder / "stderr.txt").open("w") as stderr:
        result = subprocess.run(
            args, cwd=REPO, env=subprocess_env(), stdout=stdout, stderr=stderr, check=False
        )
    if result.returncode != 0:
        return "failed"
    seconds = time.monotonic() - start
    write_marker(marker, {**record, "seconds": seconds, "args": args})
    return "done"


def job_parameters(pairs: Sequence[str]) -> dict[str, object]:
    """``KEY=VALUE`` strings as submitit executor parameters (integers where the value is one)."""
    parameters: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--job takes KEY=VALUE pairs such as timeout_min=60; got {pair!r}.")
        parameters[key] = int(value) if value.lstrip("-").isdigit() else value
    return parameters


def submit_grid(
    cells: Sequence[Cell],
    warm: Callable[[], None],
    run: Callable[[Cell], str],
    *,
    folder: Path,
    cluster: str | None,
    parameters: dict[str, object],
) -> list[tuple[Cell, str]]:
    """``warm()``, then one submitit job ``run(cell)`` per cell (all queued at once), logs under
    ``folder``; waits for every job and returns each cell's status as :func:`run_cell` gives it.
    Jobs run this checkout's functions in a process started from the current directory (the
    repository root)."""
    import submitit

    executor = submitit.AutoExecutor(folder=folder / "%j", cluster=cluster)
    executor.update_parameters(name="lm_staleness", **parameters)
    executor.submit(warm).result()
    jobs = [executor.submit(run, cell) for cell in cells]
    return [(cell, job.result()) for cell, job in zip(cells, jobs, strict=True)]


def read_cell(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalar series of a finished cell (its one event folder under ``tb/``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in folder.rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def window_mean(series: list[tuple[int, float]], window: int, *, first: bool = False) -> float:
    """Mean of the last (``first``: the first) ``window`` values of ``series``, ordered by step
    (all of them if it is shorter)."""
    if not series:
        raise ValueError("window_mean got an empty series.")
    values = [v for _, v in sorted(series)]
    values = values[:window] if first else values[-window:]
    return sum(values) / len(values)


def score(series: list[tuple[int, float]], which: str, window: int) -> float:
    """One number of a run's ``series`` for a column of :data:`METRICS` (``which``: "first",
    "final", "worst", "mean" or "last"; windows of ``window`` steps, by step)."""
    if which == "last":
        return window_mean(series, 1)
    if which == "mean":
        return window_mean(series, len(series))
    if which == "worst":
        values = [v for _, v in sorted(series)]
        return min(
            sum(values[i : i + window]) / len(values[i : i + window])
            for i in range(0, len(values), window)
        )
    return window_mean(series, window, first=which == "first")


def _interval_or_point(values: list[float]) -> tuple[float, float, float]:
    """``sweep.interval`` of ``values``, or the single value with a NaN interval."""
    if len(values) >= 2:
        return interval(values)
    return values[0], math.nan, math.nan


def summarize(
    scores: dict[tuple[int, str], dict[int, float]], *, higher_is_better: bool | None
) -> dict[tuple[int, str], dict[str, float | int | str]]:
    """Per (lag, target): mean and 95% interval over seeds, and the difference to GAE.

    The difference to the reference target (``gae``) at the same lag is paired seed by seed over
    the seeds both have; with fewer than 2 such seeds it has no interval and no verdict. A
    difference whose interval covers 0 is a ``tie``; otherwise ``better`` or ``worse`` in the
    direction ``higher_is_better`` gives (``higher`` or ``lower`` when it is None).
    """
    rows: dict[tuple[int, str], dict[str, float | int | str]] = {}
    for (lag, target), by_seed in sorted(scores.items()):
        mean, low, high = _interval_or_point(list(by_seed.values()))
        row: dict[str, float | int | str] = {"n": len(by_seed), "mean": mean, "low": low}
        row["high"] = high
        reference = scores.get((lag, REFERENCE))
        if target != REFERENCE and reference is not None and len(set(by_seed) & set(reference)) > 1:
            d, d_low, d_high, verdict = paired_difference(
                by_seed, reference, higher_is_better=higher_is_better
            )
            row.update(diff=d, diff_low=d_low, diff_high=d_high, verdict=verdict)
        rows[(lag, target)] = row
    return rows


def _interval_text(mean: float, low: float, high: float, digits: int, sign: str = "") -> str:
    """``mean [low, high]`` (just the mean when the interval is NaN: one seed)."""
    text = f"{mean:{sign}.{digits}f}"
    if not math.isnan(low):
        text += f" [{low:{sign}.{digits}f}, {high:{sign}.{digits}f}]"
    return text


def table(summaries: dict[str, dict[tuple[int, str], dict[str, float | int | str]]]) -> str:
    """Markdown: one table per metric of :data:`METRICS`, one row per (lag, target) with the
    mean over seeds, its 95% interval and the paired difference to GAE."""
    order = list(TARGETS)
    sections = []
    for name, _, _, _ in METRICS:
        rows = summaries[name]
        header = ["S", "target", "seeds", "mean [95% CI]", f"Δ vs {REFERENCE} [95% CI]", "verdict"]
        cells = []
        for lag, target in sorted(rows, key=lambda key: (key[0], order.index(key[1]))):
            row = rows[(lag, target)]
            mean = _interval_text(float(row["mean"]), float(row["low"]), float(row["high"]), 3)
            diff, verdict = "", "reference" if target == REFERENCE else ""
            if "diff" in row:
                diff = _interval_text(
                    float(row["diff"]), float(row["diff_low"]), float(row["diff_high"]), 3, "+"
                )
                verdict = str(row["verdict"])
            cells.append([lag, target, row["n"], mean, diff, verdict])
        sections.append(f"**{name}**\n\n" + markdown_table(header, cells))
    return "\n\n".join(sections)


#: The per-run table's extremes: (column, tag), the series' maximum over the run.
RUN_MAXIMA = (("max KL(π‖µ)", "kl/pi_mu"), ("max w", "weights/w_max"))


def per_run_table(
    curves: dict[tuple[int, str], dict[int, dict[str, list[tuple[int, float]]]]], window: int
) -> str:
    """Markdown: one row per run with its validation reward at every pass, how many of its rollout
    batches had a mean reward of 0 (a collapsed run: nearly all), its final-window response length
    and the maxima of :data:`RUN_MAXIMA` (how far its behaviour policy fell behind)."""
    order = list(TARGETS)
    header = ["S", "target", "seed", "val/reward per pass", "batches at reward 0"]
    header += ["length, final window", *(name for name, _ in RUN_MAXIMA)]
    rows = []
    for lag, target in sorted(curves, key=lambda key: (key[0], order.index(key[1]))):
        for seed, series in sorted(curves[(lag, target)].items()):
            validation = " → ".join(f"{v:.2f}" for _, v in sorted(series.get("val/reward", [])))
            zero = sum(v == 0.0 for _, v in series["rollout/reward"])
            length = window_mean(series["rollout/response_length"], window)
            maxima = [
                f"{max(v for _, v in series[tag]):.3g}" if series.get(tag) else "-"
                for _, tag in RUN_MAXIMA
            ]
            cells = [str(lag), target, str(seed), validation or "-", str(zero), f"{length:.0f}"]
            rows.append([*cells, *maxima])
    return "**per run**\n\n" + markdown_table(header, rows)


def _smooth(values: list[float], width: int) -> list[float]:
    """Trailing moving average over ``width`` values."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i + 1 - width) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _plot_curve(
    ax: Any, series: list[list[tuple[int, float]]], width: int, label: str
) -> tuple[float, float]:
    """One target's curve on ``ax``: mean over seeds (after a ``width``-step moving mean) with its
    95% interval shaded (with 2 seeds or more), over the steps every seed has. Returns the range
    of the seeds' own (smoothed) values, which the axis limits follow: with 3 seeds the interval
    is wide and would otherwise flatten every curve."""
    length = min(len(s) for s in series)
    steps = [step for step, _ in sorted(series[0])[:length]]
    values = [_smooth([v for _, v in sorted(s)][:length], width) for s in series]
    stats = [_interval_or_point([v[i] for v in values]) for i in range(length)]
    color = f"C{list(TARGETS).index(label)}"  # one colour per target in every panel
    (line,) = ax.plot(steps, [mean for mean, _, _ in stats], label=label, color=color)
    if len(values) >= 2:
        lows, highs = [low for _, low, _ in stats], [high for _, _, high in stats]
        ax.fill_between(steps, lows, highs, color=line.get_color(), alpha=0.2)
    return min(min(v) for v in values), max(max(v) for v in values)


def plot(
    curves: dict[tuple[int, str], dict[int, dict[str, list[tuple[int, float]]]]],
    path: Path,
    *,
    smooth: int,
) -> None:
    """PNG, one column per lag, one line per target: reward and response length (moving mean over
    ``smooth`` steps) and ``val/value_mse_mc`` vs rollout step; mean over seeds, 95% interval
    shaded (clipped to the range of the seeds' values)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (
        ("rollout/reward", smooth, f"rollout/reward ({smooth}-step moving mean)"),
        ("val/value_mse_mc", 1, "val/value_mse_mc (on-policy (V − G)²)"),
        ("rollout/response_length", smooth, f"response length ({smooth}-step moving mean)"),
    )
    lags = sorted({lag for lag, _ in curves})
    targets = [t for t in TARGETS if any(t == target for _, target in curves)]
    fig, axes = plt.subplots(
        len(rows), len(lags), figsize=(4.5 * len(lags), 3.2 * len(rows)), squeeze=False
    )
    for col, lag in enumerate(lags):
        ranges: dict[int, list[tuple[float, float]]] = {row: [] for row in range(len(rows))}
        for target in targets:
            by_seed = curves.get((lag, target), {}).values()
            for row, (tag, width, _) in enumerate(rows):
                series = [s[tag] for s in by_seed if s.get(tag)]
                if series:
                    ranges[row].append(_plot_curve(axes[row][col], series, width, target))
        for row, spans in ranges.items():
            if spans:
                low, high = min(lo for lo, _ in spans), max(hi for _, hi in spans)
                margin = 0.05 * (high - low) or 0.05
                axes[row][col].set_ylim(low - margin, high + margin)
        axes[0][col].set_title(f"lag S = {lag}")
        axes[-1][col].set_xlabel("rollout step")
        for row, (_, _, label) in enumerate(rows):
            axes[row][col].set_ylabel(label)
    for col in range(len(lags)):  # the targets differ by lag: each column names its own
        axes[0][col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def aggregate_grid(
    cells: Sequence[Cell], out: Path, *, window: int, smooth: int
) -> tuple[str, list[Cell]]:
    """Read the finished cells, write ``summary.md`` and ``curves.png``; returns the table and the
    cells that have no marker (missing)."""
    scores: dict[str, dict[tuple[int, str], dict[int, float]]] = {m[0]: {} for m in METRICS}
    curves: dict[tuple[int, str], dict[int, dict[str, list[tuple[int, float]]]]] = {}
    missing = []
    for cell in cells:
        if not (cell.folder(out) / "done.json").exists():
            missing.append(cell)
            continue
        series = read_cell(cell.folder(out))
        curves.setdefault((cell.lag, cell.target), {})[cell.seed] = series
        for name, tag, which, _ in METRICS:
            if series.get(tag):
                by_seed = scores[name].setdefault((cell.lag, cell.target), {})
                by_seed[cell.seed] = score(series[tag], which, window)
    summaries = {m[0]: summarize(scores[m[0]], higher_is_better=m[3]) for m in METRICS}
    text = table(summaries)
    if curves:
        text += "\n\n" + per_run_table(curves, window)
    (out / "summary.md").write_text(text + "\n")
    if curves:
        plot(curves, out / "curves.png", smooth=smooth)
    return text, missing


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: run the missing cells, then aggregate everything finished."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder (reused to resume)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 8, 4], help="in run order")
    parser.add_argument("--targets", nargs="+", default=DEFAULT_TARGETS, choices=list(TARGETS))
    parser.add_argument("--steps", type=int, default=200, help="rollout steps per cell")
    parser.add_argument("--every", type=int, default=20, help="validate every this many steps")
    parser.add_argument("--window", type=int, default=20, help="final window of rollout/reward")
    parser.add_argument("--smooth", type=int, default=10, help="moving mean of the reward plot")
    parser.add_argument("--workers", type=int, default=1, help="cells run at the same time")
    parser.add_argument("--config", type=Path, default=RECIPE, help="the recipe")
    parser.add_argument("--aggregate-only", action="store_true", help="run no cell")
    parser.add_argument(
        "--launcher",
        choices=["local", "submitit"],
        default="local",
        help="run cells in --workers local threads, or as submitit jobs (SLURM on a cluster)",
    )
    parser.add_argument(
        "--cluster",
        default=None,
        choices=["slurm", "local", "debug"],
        help="submitit's cluster (default: SLURM where available, else local processes)",
    )
    parser.add_argument(
        "--job",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="submitit executor parameters, e.g. slurm_partition=cpu timeout_min=60",
    )
    parser.add_argument("extra", nargs="*", help="more CLI overrides for every cell, after --")
    args = parser.parse_args(argv)
    if args.steps < args.every or args.steps % args.every:
        parser.error(f"--steps ({args.steps}) must be a multiple of --every ({args.every}).")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1; got {args.workers}.")
    if args.launcher == "local" and (args.cluster or args.job):
        parser.error(
            f"--cluster and --job configure --launcher submitit; got --cluster {args.cluster} "
            f"--job {' '.join(args.job) or '(none)'} with --launcher local"
        )
    try:
        parameters = job_parameters(args.job)
    except ValueError as error:
        parser.error(str(error))
    cells = grid(args.lags, args.targets, args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.aggregate_only:
        warm = functools.partial(warm_start, args.out, args.config, args.extra)
        run = functools.partial(
            run_cell,
            out=args.out,
            steps=args.steps,
            every=args.every,
            recipe=args.config,
            extra=args.extra,
        )
        if args.launcher == "submitit":
            submitted = submit_grid(
                cells,
                warm,
                run,
                folder=args.out / "submitit",
                cluster=args.cluster,
                parameters=parameters,
            )
            for cell, status in submitted:
                print(f"{time.strftime('%H:%M:%S')} {cell}: {status}", flush=True)
        else:
            warm()

            def one(cell: Cell) -> None:
                start = time.monotonic()
                status = run(cell)
                seconds = time.monotonic() - start
                print(
                    f"{time.strftime('%H:%M:%S')} {cell}: {status} in {seconds:.0f} s", flush=True
                )

            with ThreadPoolExecutor(args.workers) as pool:
                list(pool.map(one, cells))
    text, missing = aggregate_grid(cells, args.out, window=args.window, smooth=args.smooth)
    print(text)
    if missing:
        print(f"missing cells ({len(missing)}): " + ", ".join(str(c) for c in missing))


if __name__ == "__main__":
    main()
