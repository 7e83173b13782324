"""Sweep harness for the closed-loop simulator: a YAML grid, one folder per cell, paired aggregation.

Run with ``python -m brace_lightning.sweep GRID.yaml OUT_DIR --workers N``. The grid file holds

.. code-block:: yaml

    base: {horizon: 64, versions: 50}          # ClosedLoopConfig fields shared by every cell
    grid: {staleness: [0, 4], seed: [0, 1, 2]} # ClosedLoopConfig fields to cross
    targets:                                    # name -> class in brace_lightning.targets
      gae: {class_path: GAE}
      brace: {class_path: BRACE, init_args: {k: 100}}
    objectives:                                 # name -> class in brace_lightning.objectives
      ppo: {class_path: PPOClip}
    metric: gap_pi                              # VersionLog field summarized per cell
    reference: gae                              # target every other target is paired against

Each cell writes ``OUT_DIR/<cell>/log.json`` (the whole :class:`~brace_lightning.sim.VersionLog`);
cells whose file exists are skipped, so an interrupted sweep resumes. A cell's score is the mean of
``metric`` over the last quarter of its versions. :func:`aggregate` reports, per setting, the mean
and 95% Student-t interval over seeds and the paired difference against the reference target at
the same setting and seed; a difference whose interval covers 0 is a tie.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Cell", "aggregate", "cells", "interval", "main", "run_cell", "run_grid"]

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
    keys = sorted(grid)
    out = []
    for target, objective in itertools.product(spec["targets"], spec["objectives"]):
        for values in itertools.product(*(grid[k] for k in keys)):
            config = {**spec.get("base", {}), **dict(zip(keys, values, strict=True))}
            parts = [f"target={target}", f"objective={objective}"]
            parts += [f"{k}={v}" for k, v in zip(keys, values, strict=True)]
            out.append(
                {"name": ",".join(parts), "target": target, "objective": objective, **config}
            )
    return out


def _build(module: str, entry: dict[str, Any]) -> Any:
    import importlib

    cls = getattr(importlib.import_module(module), entry["class_path"].rsplit(".", 1)[-1])
    return cls(**entry.get("init_args", {}))


def run_cell(spec: dict[str, Any], cell: Cell, out_dir: Path) -> Path:
    """Run one cell (unless its ``log.json`` exists) and return the file's path."""
    from brace_lightning.sim.closed_loop import ClosedLoopConfig, run_closed_loop

    path = out_dir / cell["name"] / "log.json"
    if path.exists():
        return path
    config = {k: v for k, v in cell.items() if k not in ("name", "target", "objective")}
    target = _build("brace_lightning.targets", spec["targets"][cell["target"]])
    objective = _build("brace_lightning.objectives", spec["objectives"][cell["objective"]])
    log = run_closed_loop(ClosedLoopConfig(**config), target, objective)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps({"cell": cell, "log": log.as_dict()}))
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


def score(log: dict[str, Any], metric: str) -> float:
    """Mean of ``metric`` over the last quarter of the versions."""
    values = log[metric]
    tail = values[len(values) - max(1, len(values) // 4) :]
    return sum(tail) / len(tail)


def aggregate(
    scores: dict[str, dict[int, float]], reference: str, *, target_of: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Mean ± 95% interval per setting, and the paired difference to the reference at each setting.

    Args:
        scores: setting name (without the seed, containing ``target=<name>``) → seed → score.
        reference: the reference target's name; each setting is paired with the setting whose
            name has ``target=<reference>`` in place of its own target, seed by seed.
        target_of: setting → target name (parsed from ``target=...`` in the name if None).

    Returns:
        One row per setting: ``setting, mean, low, high, diff, diff_low, diff_high, verdict``
        (verdict ``better``/``worse`` — lower is better — or ``tie`` when the interval covers 0;
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
            verdict = "tie" if d_low <= 0.0 <= d_high else ("better" if d < 0 else "worse")
            row.update(diff=d, diff_low=d_low, diff_high=d_high, verdict=verdict)
        rows.append(row)
    return rows


def collect(spec: dict[str, Any], out_dir: Path) -> dict[str, dict[int, float]]:
    """Scores of the finished cells, grouped by setting (cell name without its seed)."""
    scores: dict[str, dict[int, float]] = {}
    for cell in cells(spec):
        path = out_dir / cell["name"] / "log.json"
        if not path.exists():
            continue
        log = json.loads(path.read_text())["log"]
        setting = ",".join(p for p in cell["name"].split(",") if not p.startswith("seed="))
        scores.setdefault(setting, {})[int(cell.get("seed", 0))] = score(log, spec["metric"])
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


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: run a grid, then print its table and write ``summary.md`` and ``summary.png``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", type=Path, help="the grid YAML file")
    parser.add_argument("out_dir", type=Path, help="folder of the cells (reused to resume)")
    parser.add_argument("--workers", type=int, default=1, help="local worker processes")
    args = parser.parse_args(argv)
    spec = yaml.safe_load(args.grid.read_text())
    run_grid(spec, args.out_dir, workers=args.workers)
    rows = aggregate(
        collect(spec, args.out_dir), spec.get("reference", next(iter(spec["targets"])))
    )
    text = table(rows)
    print(text)
    (args.out_dir / "summary.md").write_text(text + "\n")
    plot(rows, args.out_dir / "summary.png", spec["metric"])


if __name__ == "__main__":
    main()
