"""Sweep harness for the closed-loop simulator: a YAML grid, one folder per cell, paired aggregation.

Run with ``python -m brace_lightning.sweep GRID.yaml OUT_DIR --workers N``. The grid file holds

.. code-block:: yaml

    base: {horizon: 64, versions: 50}          # ClosedLoopConfig fields shared by every cell
    grid: {staleness: [0, 4], seed: [0, 1, 2]} # ClosedLoopConfig fields to cross
    variants:                                   # optional: named bundles of fields, crossed too
      tabular: {critic: tabular, critic_lr: 0.5}
      mlp: {critic: mlp, critic_lr: 0.01}
    targets:                                    # name -> class in brace_lightning.targets
      gae: {class_path: GAE}
      brace: {class_path: BRACE, init_args: {k: 100}}
    objectives:                                 # name -> class in brace_lightning.objectives
      ppo: {class_path: PPOClip}
    metric: gap_pi                              # VersionLog field(s) summarized per cell
    window: 0.25                                # score = mean over this last fraction of versions
    higher_is_better: [value_pi]                # metrics whose verdict favours larger values
    signed: [label_bias]                        # metrics with no better side: "differs" or "tie"
    shadows: [gae, brace]                       # optional: extra critics on the same data (below)
    drivers: [gae]                              # optional: the targets that get cells (default all)
    reference: gae                              # target every other target is paired against

``metric`` is one :class:`~brace_lightning.sim.VersionLog` field or a list of them (the first is
printed). Each cell writes ``OUT_DIR/<cell>/log.json`` (the whole log and its wall time); cells
whose file exists are skipped, so an interrupted sweep resumes. A cell's score is the mean of a
metric over the last ``window`` fraction of its versions (1.0: the whole run, an area under the
curve). :func:`aggregate` reports, per setting, the mean and 95% Student-t interval over seeds and
the paired difference against the reference target at the same setting and seed; a difference
whose interval covers 0 is a tie. Per metric, ``summary_<metric>.png`` shows the scores and
``curves_<metric>.png`` the per-version means with their intervals (one panel per setting, one
line per target); ``beta.png`` shows β by remaining horizon averaged over the window.

``shadows`` (names from ``targets``) adds one critic per listed target to every run, trained on
the same batches but never used by the actor (``run_closed_loop``'s ``shadow_targets``): the cell's
own target drives the actor, and the tables compare the shadow critics' ĝ_π on one actor
trajectory, which removes the actor's reaction to its critic from the comparison.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "Cell",
    "aggregate",
    "cells",
    "collect",
    "interval",
    "main",
    "metrics",
    "plot_beta",
    "plot_curves",
    "run_cell",
    "run_grid",
    "score",
    "summarize",
    "window",
]

Cell = dict[str, Any]

# Two-sided 95% Student-t quantiles t_{0.975, df} for df = 1..30; above 30 the normal's 1.96.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]  # fmt: skip


def interval(samples: Sequence[float]) -> tuple[float, float, float]:
    """Mean and 95% Student-t interval ``(mean, low, high)`` of ``samples`` (≥ 2 values)."""
    n = len(samples)
    if n < 2:
        raise ValueError(f"samples must hold at least 2 values for an interval; got {n}.")
    mean = sum(samples) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in samples) / (n - 1))
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * std / math.sqrt(n)
    return mean, mean - half, mean + half


def cells(spec: dict[str, Any]) -> list[Cell]:
    """Every cell of the grid: one dict with ``name``, ``target``, ``objective`` and ``config``."""
    for key in ("targets", "objectives", "metric"):
        if key not in spec:
            raise ValueError(f"the grid file must have a '{key}' entry; got keys {sorted(spec)}.")
    grid: dict[str, list[Any]] = spec.get("grid", {})
    variants: dict[str, dict[str, Any]] = spec.get("variants", {"": {}})
    keys = sorted(grid)
    out = []
    drivers = spec.get("drivers", list(spec["targets"]))
    for target, objective, variant in itertools.product(drivers, spec["objectives"], variants):
        for values in itertools.product(*(grid[k] for k in keys)):
            config = {
                **spec.get("base", {}),
                **variants[variant],
                **dict(zip(keys, values, strict=True)),
            }
            parts = [f"target={target}", f"objective={objective}"]
            parts += [f"variant={variant}"] if variant else []
            parts += [f"{k}={v}" for k, v in zip(keys, values, strict=True)]
            cell = {"name": ",".join(parts), "target": target, "objective": objective, **config}
            out.append(cell)
    return out


def _build(module: str, entry: dict[str, Any]) -> Any:
    import importlib

    cls = getattr(importlib.import_module(module), entry["class_path"].rsplit(".", 1)[-1])
    return cls(**entry.get("init_args", {}))


def run_cell(spec: dict[str, Any], cell: Cell, out_dir: Path) -> Path:
    """Run one cell (unless its ``log.json`` exists) and return the file's path."""
    from brace_lightning.closed_loop import ClosedLoopConfig, run_closed_loop

    path = out_dir / cell["name"] / "log.json"
    if path.exists():
        return path
    config = {k: v for k, v in cell.items() if k not in ("name", "target", "objective")}
    target = _build("brace_lightning.targets", spec["targets"][cell["target"]])
    objective = _build("brace_lightning.objectives", spec["objectives"][cell["objective"]])
    shadows = {
        name: _build("brace_lightning.targets", spec["targets"][name])
        for name in spec.get("shadows", [])
    }
    start = time.perf_counter()
    log = run_closed_loop(ClosedLoopConfig(**config), target, objective, shadow_targets=shadows)
    seconds = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps({"cell": cell, "seconds": seconds, "log": log.as_dict()}))
    partial.rename(path)  # atomic: a killed cell leaves no log.json and reruns
    return path


def _run_star(args: tuple[dict[str, Any], Cell, Path]) -> Path:
    return run_cell(*args)


def run_grid(spec: dict[str, Any], out_dir: Path, *, workers: int = 1) -> list[Path]:
    """Run every cell of ``spec`` into ``out_dir`` with ``workers`` processes, showing progress."""
    from tqdm import tqdm

    if workers < 1:
        raise ValueError(f"workers must be >= 1; got {workers!r}.")
    todo = [(spec, cell, out_dir) for cell in cells(spec)]
    if workers == 1:
        return [_run_star(item) for item in tqdm(todo, desc="cells")]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return list(tqdm(pool.imap(_run_star, todo), total=len(todo), desc="cells"))


def metrics(spec: dict[str, Any]) -> list[str]:
    """The grid's metric names (``metric`` may be one name or a list)."""
    metric = spec["metric"]
    names = [metric] if isinstance(metric, str) else metric
    if not isinstance(names, list) or not names or not all(isinstance(name, str) for name in names):
        raise ValueError(f"metric must be a field name or a list of them; got {metric!r}.")
    return names


def window(spec: dict[str, Any]) -> float:
    """The fraction of the last versions a score averages over (``window``, default 0.25)."""
    value = spec.get("window", 0.25)
    if not isinstance(value, int | float) or not 0.0 < value <= 1.0:
        raise ValueError(f"window must be a fraction in (0, 1]; got {value!r}.")
    return float(value)


def _tail(values: list[Any], fraction: float) -> list[Any]:
    """The last ``fraction`` of ``values`` (at least one)."""
    return values[len(values) - max(1, round(len(values) * fraction)) :]


def score(log: dict[str, Any], metric: str, fraction: float = 0.25) -> float:
    """Mean of ``metric`` over the last ``fraction`` of the versions (at least one)."""
    tail = _tail(log[metric], fraction)
    return sum(tail) / len(tail)


def aggregate(
    scores: dict[str, dict[int, float]],
    reference: str,
    *,
    target_of: dict[str, str] | None = None,
    higher_is_better: bool | None = False,
) -> list[dict[str, Any]]:
    """Mean ± 95% interval per setting, and the paired difference to the reference at each setting.

    Args:
        scores: setting name (without the seed, containing ``target=<name>``) → seed → score.
        reference: the reference target's name; each setting is paired with the setting whose
            name has ``target=<reference>`` in place of its own target, seed by seed.
        target_of: setting → target name (parsed from ``target=...`` in the name if None).
        higher_is_better: the verdict's direction (False: lower is better, as for ĝ_π; None:
            no direction, as for a signed bias, and a difference is called ``differs``).

    Returns:
        One row per setting: ``setting, mean, low, high, diff, diff_low, diff_high, verdict``
        (verdict ``better``/``worse`` in the metric's direction, or ``tie`` when the interval covers 0;
        the diff fields are None for the reference itself).
    """
    rows = []
    for setting, by_seed in sorted(scores.items()):
        target = (target_of or {}).get(setting) or setting.split("target=")[1].split(",")[0]
        mean, low, high = interval(list(by_seed.values()))
        row: dict[str, Any] = {"setting": setting, "mean": mean, "low": low, "high": high}
        row.update(diff=None, diff_low=None, diff_high=None, verdict=None)
        partner = setting.replace(f"target={target}", f"target={reference}", 1)
        if target != reference and partner in scores:
            seeds = sorted(set(by_seed) & set(scores[partner]))
            diffs = [by_seed[s] - scores[partner][s] for s in seeds]
            d, d_low, d_high = interval(diffs)
            improved = d > 0 if higher_is_better else d < 0
            verdict = (
                "tie"
                if d_low <= 0.0 <= d_high
                else ("differs" if higher_is_better is None else "better" if improved else "worse")
            )
            row.update(diff=d, diff_low=d_low, diff_high=d_high, verdict=verdict)
        rows.append(row)
    return rows


def _setting(name: str) -> str:
    return ",".join(p for p in name.split(",") if not p.startswith("seed="))


Logs = list[tuple[Cell, dict[str, Any]]]


def _logs(spec: dict[str, Any], out_dir: Path) -> Logs:
    """The finished cells with their logs.

    With ``shadows`` in the spec, each cell stands for one entry per shadow critic instead: named
    ``target=<shadow>,driver=<cell's target>,…``, whose ``gap_pi`` is that critic's ĝ_π (the other
    fields are the shared run's), so the tables pair critics seed by seed on the same data.
    """
    out = []
    for cell in cells(spec):
        path = out_dir / cell["name"] / "log.json"
        if not path.exists():
            continue
        log = json.loads(path.read_text())["log"]
        if not spec.get("shadows"):
            out.append((cell, log))
            continue
        for shadow in spec["shadows"]:
            driver = f"target={cell['target']}"
            name = cell["name"].replace(driver, f"target={shadow},driver={cell['target']}", 1)
            shadow_log = {**log, "gap_pi": log["shadow_gap_pi"][shadow]}
            out.append(({**cell, "name": name, "target": shadow}, shadow_log))
    return out


def collect(
    spec: dict[str, Any], out_dir: Path, metric: str | None = None
) -> dict[str, dict[int, float]]:
    """Scores of the finished cells for ``metric`` (the first if None), grouped by setting."""
    return _scores(spec, _logs(spec, out_dir), metric or metrics(spec)[0])


def _scores(spec: dict[str, Any], logs: Logs, metric: str) -> dict[str, dict[int, float]]:
    scores: dict[str, dict[int, float]] = {}
    for cell, log in logs:
        by_seed = scores.setdefault(_setting(cell["name"]), {})
        by_seed[int(cell.get("seed", 0))] = score(log, metric, window(spec))
    return scores


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of :func:`aggregate`'s rows."""
    lines = [
        "| setting | mean [95% CI] | diff vs reference [95% CI] | verdict |",
        "|---|---|---|---|",
    ]
    for r in rows:
        diff = (
            ""
            if r["diff"] is None
            else f"{r['diff']:+.4f} [{r['diff_low']:+.4f}, {r['diff_high']:+.4f}]"
        )
        lines.append(
            f"| {r['setting']} | {r['mean']:.4f} [{r['low']:.4f}, {r['high']:.4f}] | {diff} | {r['verdict'] or 'reference'} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, metric: str) -> None:
    """A PNG with each setting's mean and 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    for i, r in enumerate(rows):
        ax.errorbar(r["mean"], i, xerr=[[r["mean"] - r["low"]], [r["high"] - r["mean"]]], fmt="o")
    ax.set_yticks(range(len(rows)), [r["setting"] for r in rows], fontsize=7)
    ax.set_xlabel(f"{metric} (mean, 95% interval over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _panels(logs: Logs) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Finished logs grouped as panel (the setting without its target) → target → logs, panels in
    the grid's order (T = 64 before 256 before 1024, not sorted as text)."""
    panels: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for cell, log in logs:
        panel = ",".join(
            p for p in _setting(cell["name"]).split(",") if not p.startswith("target=")
        )
        panels.setdefault(panel, {}).setdefault(cell["target"], []).append(log)
    return panels


def _figure(count: int) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(count, 3)
    rows = math.ceil(count / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:count])


def _mean_band(series: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Per position: mean and 95% interval over the series (the mean alone for one series)."""
    means, lows, highs = [], [], []
    for values in zip(*series, strict=False):
        if len(values) >= 2:
            mean, low, high = interval(list(values))
        else:
            mean = low = high = values[0]
        means.append(mean)
        lows.append(low)
        highs.append(high)
    return means, lows, highs


def plot_curves(logs: Logs, metric: str, path: Path) -> None:
    """Per-version mean of ``metric`` over seeds with its 95% band, one line per target."""
    import matplotlib.pyplot as plt

    panels = _panels(logs)
    fig, axes = _figure(len(panels))
    for ax, (panel, by_target) in zip(axes, panels.items(), strict=True):
        for target, logs in sorted(by_target.items()):
            mean, low, high = _mean_band([log[metric] for log in logs])
            steps = range(len(mean))
            ax.plot(steps, mean, label=target)
            ax.fill_between(steps, low, high, alpha=0.2)
        ax.set_title(panel or "all", fontsize=8)
        ax.set_xlabel("version")
        ax.set_ylabel(metric)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_beta(logs: Logs, fraction: float, path: Path) -> None:
    """β per remaining-horizon bin, averaged over each run's last ``fraction`` and then over seeds."""
    import matplotlib.pyplot as plt

    panels = _panels(logs)
    fig, axes = _figure(len(panels))
    for ax, (panel, by_target) in zip(axes, panels.items(), strict=True):
        for target, logs in sorted(by_target.items()):
            per_seed = []
            for log in logs:
                per_bin = []
                for values in zip(*_tail(log["beta"], fraction), strict=True):
                    defined = [v for v in values if v is not None]
                    per_bin.append(sum(defined) / len(defined) if defined else math.nan)
                per_seed.append(per_bin)
            mean, low, high = _mean_band(per_seed)
            edges = logs[0]["beta_edges"]
            ax.plot(edges, mean, marker="o", label=target)
            ax.fill_between(edges, low, high, alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_title(panel or "all", fontsize=8)
        ax.set_xlabel("remaining horizon T - t (bin left edge)")
        ax.set_ylabel("β (slope of label on return)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summarize(spec: dict[str, Any], out_dir: Path) -> str:
    """Write ``summary.md`` and the PNGs for every metric; return the markdown."""
    reference = spec.get("reference", next(iter(spec["targets"])))
    logs = _logs(spec, out_dir)  # read once for every metric and plot
    sections = []
    for metric in metrics(spec):
        higher: bool | None = metric in spec.get("higher_is_better", [])
        if not higher and metric in spec.get("signed", []):
            higher = None
        rows = aggregate(_scores(spec, logs, metric), reference, higher_is_better=higher)
        direction = {True: "higher is better", False: "lower is better", None: "signed"}[higher]
        sections.append(f"### {metric} ({direction})\n\n{table(rows)}\n")
        plot(rows, out_dir / f"summary_{metric}.png", metric)
        plot_curves(logs, metric, out_dir / f"curves_{metric}.png")
    if not spec.get("shadows") and logs and "beta" in logs[0][1]:
        plot_beta(logs, window(spec), out_dir / "beta.png")
    paths = [out_dir / cell["name"] / "log.json" for cell in cells(spec)]
    seconds = [json.loads(p.read_text()).get("seconds", 0.0) for p in paths if p.exists()]
    median = sorted(seconds)[len(seconds) // 2] if seconds else 0.0
    footer = f"{len(seconds)} cells, median {median:.1f} s per cell."
    text = "\n".join(sections) + "\n" + footer + "\n"
    (out_dir / "summary.md").write_text(text)
    return text


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: run a grid, then print its tables and write ``summary.md`` and the plots."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", type=Path, help="the grid YAML file")
    parser.add_argument("out_dir", type=Path, help="folder of the cells (reused to resume)")
    parser.add_argument("--workers", type=int, default=1, help="local worker processes")
    args = parser.parse_args(argv)
    spec = yaml.safe_load(args.grid.read_text())
    metrics(spec)
    window(spec)
    run_grid(spec, args.out_dir, workers=args.workers)
    print(summarize(spec, args.out_dir))


if __name__ == "__main__":
    main()
