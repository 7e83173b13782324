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
    signed: [label_bias]                        # metrics with no better side: "differs"
    shadows: [gae, brace]                       # optional: extra critics on the same data (below)
    drivers: [gae]                              # optional: the targets that get cells (default all)
    reference: gae                              # target every other target is paired against
    margins: {gap_pi: 0.01}                     # optional: equivalence margin per metric
    post_hoc: [label_bias]                      # optional: metrics chosen after results were seen
    survival: {metric: value_pi, threshold: 0.05}  # optional: survive/collapse, exact tests
    primary:                                    # optional: the pre-registered primary outcome
      date: 2026-12-06                          # the day it was declared, before the runs
      question: does BRACE train the actor faster than GAE?
      metric: value_pi
      comparisons: [brace]                      # targets compared with the primary reference
      reference: gae
      margin: 0.02                              # equivalence margin: "tie" only inside ±margin

``metric`` is one :class:`~brace_lightning.sim.VersionLog` field or a list of them (the first is
printed). Each cell writes ``OUT_DIR/<cell>/log.json`` (the whole log and its wall time); cells
whose file exists are skipped, so an interrupted sweep resumes. A cell's score is the mean of a
metric over the last ``window`` fraction of its versions (1.0: the whole run, an area under the
curve). :func:`aggregate` reports, per setting, the mean and 95% Student-t interval over seeds and
the paired difference against the reference target at the same setting and seed; a difference is
called a tie only when its interval lies inside the metric's stated margin (``margins``, or the
primary's ``margin``), otherwise, when the interval covers 0, ``inconclusive (±half-width)``.
These per-metric tables are secondary: their intervals are not adjusted for multiplicity, and a
metric listed in ``post_hoc`` is marked as chosen after the results were seen.

``primary`` declares the grid's one primary outcome with its date: every pair (comparison target,
setting) against the primary reference is one member of the family; :func:`primary_table` gives
each its paired t-test, Holm's adjusted p-value over the family and the interval at its Holm step's
level (:mod:`brace_lightning.statistics`), and calls it better/worse only when the Holm-adjusted p
is below 0.05. ``survival`` counts, per setting, the seeds whose last value of ``metric`` is at
least ``threshold`` and compares them with the reference target's by an exact test
(:func:`survival_table`: McNemar's paired by seed, Fisher's when the seeds do not pair), Holm over
the table. Per metric, ``summary_<metric>.png`` shows the scores and
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
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from brace_lightning.statistics import (
    fisher_exact,
    holm,
    holm_levels,
    mcnemar_exact,
    paired_t_test,
    verdict,
)

__all__ = [
    "Cell",
    "aggregate",
    "cells",
    "collect",
    "copy_atomic",
    "interval",
    "main",
    "markdown_table",
    "metrics",
    "paired_difference",
    "plot_beta",
    "plot_curves",
    "primary_table",
    "run_cell",
    "run_grid",
    "score",
    "summarize",
    "survival_table",
    "table_header",
    "table_row",
    "window",
    "write_marker",
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


#: What pairs two runs in :func:`paired_difference`: a seed, or a (warm start, seed) pair, a run name.
RunKey = TypeVar("RunKey")


def paired_difference(
    by_seed: Mapping[RunKey, float],
    reference: Mapping[RunKey, float],
    *,
    higher_is_better: bool | None,
    margin: float | None = None,
) -> tuple[float, float, float, str]:
    """Mean and 95% interval of ``by_seed[s] - reference[s]`` over the (sortable) keys both hold, and its
    verdict: ``better``/``worse`` in the direction ``higher_is_better`` gives (``higher``/``lower``
    when it is None, a metric with no better side) when the interval excludes 0; ``tie (±margin)``
    when it lies inside ±``margin``; else ``inconclusive (±half-width)``. Pairing seed by seed
    removes what the seed shares across targets (its prompts, its sampling noise).

    Raises:
        ValueError: when fewer than 2 seeds are shared (no interval).
    """
    seeds = sorted(set(by_seed) & set(reference))
    d, low, high = interval([by_seed[s] - reference[s] for s in seeds])
    significant = not low <= 0.0 <= high
    word = verdict(
        low, high, significant=significant, higher_is_better=higher_is_better, margin=margin, mean=d
    )
    return d, low, high, word


def write_marker(path: Path, payload: Any, *, indent: int | None = None) -> None:
    """Write a cell's resume marker (JSON) atomically: a cell killed while writing leaves no
    marker, so a rerun runs it again; a cell with a marker is skipped. ``indent`` as
    :func:`json.dumps` (an indented file ends with a newline)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(payload, indent=indent) + ("" if indent is None else "\n"))
    partial.replace(path)


def copy_atomic(source: Path, target: Path) -> None:
    """Copy the file or folder ``source`` to ``target`` through a ``.partial`` sibling, so a copy
    stopped halfway leaves no ``target`` (a folder ``target`` must not exist yet)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    if source.is_dir():
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(source, partial)
    else:
        shutil.copyfile(source, partial)
    partial.replace(target)


def table_header(header: Sequence[str]) -> str:
    """A markdown table's first two lines: ``| a | b |`` and ``|---|---|``."""
    return table_row(header) + "\n|" + "---|" * len(header)


def table_row(cells: Sequence[object]) -> str:
    """One markdown table row: ``| a | b |`` (each cell as ``str`` gives it)."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (no trailing newline): the one table writer of the sweeps and of every
    benchmark script (``benchmarks/_common.py`` re-exports it); scripts that print rows as they
    are measured print :func:`table_header` first, then each :func:`table_row`."""
    return "\n".join([table_header(header), *(table_row(row) for row in rows)])


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
    write_marker(path, {"cell": cell, "seconds": seconds, "log": log.as_dict()})
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
    margin: float | None = None,
) -> list[dict[str, Any]]:
    """Mean ± 95% interval per setting, and the paired difference to the reference at each setting.

    Args:
        scores: setting name (without the seed, containing ``target=<name>``) → seed → score.
        reference: the reference target's name; each setting is paired with the setting whose
            name has ``target=<reference>`` in place of its own target, seed by seed.
        target_of: setting → target name (parsed from ``target=...`` in the name if None).
        higher_is_better: the verdict's direction (False: lower is better, as for ĝ_π; None:
            no direction, as for a signed bias, and a difference is called ``differs``).
        margin: the equivalence margin of a ``tie`` (None: no difference is called a tie).

    Returns:
        One row per setting: ``setting, mean, low, high, diff, diff_low, diff_high, verdict``
        (verdict of :func:`paired_difference`; the diff fields are None for the reference itself).
    """
    rows = []
    for setting, by_seed in sorted(scores.items()):
        target = (target_of or {}).get(setting) or setting.split("target=")[1].split(",")[0]
        mean, low, high = interval(list(by_seed.values()))
        row: dict[str, Any] = {"setting": setting, "mean": mean, "low": low, "high": high}
        row.update(diff=None, diff_low=None, diff_high=None, verdict=None)
        partner = setting.replace(f"target={target}", f"target={reference}", 1)
        if target != reference and partner in scores:
            d, d_low, d_high, word = paired_difference(
                by_seed, scores[partner], higher_is_better=higher_is_better, margin=margin
            )
            if word in ("higher", "lower"):
                word = "differs"  # the sweep's word for a signed metric's difference
            row.update(diff=d, diff_low=d_low, diff_high=d_high, verdict=word)
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


def _partner(setting: str, target: str, reference: str) -> str:
    return setting.replace(f"target={target}", f"target={reference}", 1)


def _target(setting: str) -> str:
    return setting.split("target=")[1].split(",")[0]


def check_primary(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The grid's ``primary`` block, checked (None when it has none)."""
    primary = spec.get("primary")
    if primary is None:
        return None
    keys = {"date", "question", "metric", "comparisons", "reference", "margin"}
    if not isinstance(primary, dict) or set(primary) != keys:
        raise ValueError(
            f"primary must be a mapping with the keys {sorted(keys)}; got {primary!r}."
        )
    for name in [*primary["comparisons"], primary["reference"]]:
        if name not in spec["targets"]:
            raise ValueError(
                f"primary names the target {name!r}, which is not in targets {sorted(spec['targets'])}."
            )
    if not isinstance(primary["margin"], int | float) or primary["margin"] <= 0:
        raise ValueError(f"primary margin must be a number > 0; got {primary['margin']!r}.")
    return primary


def holm_rows(
    family: Sequence[tuple[str, list[float]]],
    *,
    higher_is_better: bool | None,
    margin: float,
    beyond_margin: bool = False,
) -> list[list[Any]]:
    """Table rows of a pre-registered family of paired comparisons ``(label, differences)``:
    ``[label, n, "mean [low, high] (level%)", p, Holm p, verdict]``, the interval at each
    comparison's Holm step's level. better/worse when the Holm-adjusted p is below 0.05 (and, with
    ``beyond_margin``, the interval lies wholly beyond ±``margin``); a tie only when the interval
    lies inside ±``margin``; otherwise inconclusive."""
    p_values = [paired_t_test(diffs)[3] for _, diffs in family]
    rows = []
    for (label, diffs), p, adjusted, level in zip(
        family, p_values, holm(p_values), holm_levels(p_values), strict=True
    ):
        mean, low, high, _ = paired_t_test(diffs, alpha=level)
        beyond = not beyond_margin or low > margin or high < -margin
        word = verdict(
            low, high, significant=adjusted < 0.05 and beyond, higher_is_better=higher_is_better,
            margin=margin, mean=mean,
        )  # fmt: skip
        ci = f"{mean:+.4f} [{low:+.4f}, {high:+.4f}] ({100 * (1 - level):.2f}%)"
        rows.append([label, len(diffs), ci, f"{p:.3g}", f"{adjusted:.3g}", word])
    return rows


def primary_table(
    scores: dict[str, dict[int, float]], primary: dict[str, Any], *, higher_is_better: bool | None
) -> str:
    """The primary outcome's family: one row per (comparison target, setting) paired with the
    primary reference, its paired t-test, Holm-adjusted p over the family and the interval at its
    Holm step's level; better/worse only when the Holm-adjusted p is below 0.05, a tie only when
    that interval lies inside ±margin, otherwise inconclusive."""
    family = []
    for setting, by_seed in sorted(scores.items()):
        target = _target(setting)
        partner = _partner(setting, target, primary["reference"])
        if target in primary["comparisons"] and partner in scores:
            seeds = sorted(set(by_seed) & set(scores[partner]))
            diffs = [by_seed[s] - scores[partner][s] for s in seeds]
            family.append((setting, diffs))
    rows = holm_rows(
        family,
        higher_is_better=higher_is_better,
        margin=float(primary["margin"]),
    )
    head = (
        f"### Primary outcome (pre-registered {primary['date']}): {primary['metric']}\n\n"
        f"{primary['question']} Family: {len(rows)} comparisons against "
        f"`{primary['reference']}`, Holm-adjusted; equivalence margin ±{primary['margin']:g}.\n\n"
    )
    header = ["setting", "seeds", "diff [Holm-level CI]", "p", "Holm p", "verdict"]
    return head + markdown_table(header, rows) + "\n"


def _survived(log: dict[str, Any], survival: dict[str, Any]) -> bool:
    return log[survival["metric"]][-1] >= survival["threshold"]


def survival_table(spec: dict[str, Any], logs: Logs) -> str:
    """Survive/collapse counts per setting against the reference target by an exact test:
    McNemar's (paired by seed) when both settings hold the same seeds, else Fisher's; then the
    same pooled over settings per target; Holm over the per-setting rows."""
    survival = spec["survival"]
    reference = spec.get("reference", next(iter(spec["targets"])))
    outcomes: dict[str, dict[int, bool]] = {}
    for cell, log in logs:
        outcomes.setdefault(_setting(cell["name"]), {})[int(cell.get("seed", 0))] = _survived(
            log, survival
        )
    pooled: dict[str, list[tuple[bool, bool]]] = {}
    family = []
    for setting, by_seed in sorted(outcomes.items()):
        target = _target(setting)
        other = outcomes.get(_partner(setting, target, reference))
        if target == reference or other is None:
            continue
        if set(by_seed) == set(other):
            pairs = [(by_seed[s], other[s]) for s in sorted(by_seed)]
            pooled.setdefault(target, []).extend(pairs)
            only_first = sum(a and not b for a, b in pairs)
            only_second = sum(b and not a for a, b in pairs)
            test, p = "McNemar (paired)", mcnemar_exact(only_first, only_second)
        else:
            a, c = sum(by_seed.values()), sum(other.values())
            test, p = "Fisher", fisher_exact(a, len(by_seed) - a, c, len(other) - c)
        counts = f"{sum(by_seed.values())}/{len(by_seed)} vs {sum(other.values())}/{len(other)}"
        family.append([setting, counts, test, p])
    rows = [
        [*row[:3], f"{row[3]:.3g}", f"{adjusted:.3g}"]
        for row, adjusted in zip(family, holm([row[3] for row in family]), strict=True)
    ]
    for target, pairs in sorted(pooled.items()):
        only_first = sum(a and not b for a, b in pairs)
        only_second = sum(b and not a for a, b in pairs)
        first, second = sum(a for a, _ in pairs), sum(b for _, b in pairs)
        counts = f"{first}/{len(pairs)} vs {second}/{len(pairs)}"
        p = mcnemar_exact(only_first, only_second)
        rows.append([f"target={target}, all settings", counts, "McNemar (paired)", f"{p:.3g}", ""])
    head = (
        f"### Survival: last {survival['metric']} ≥ {survival['threshold']:g}\n\n"
        f"Survived runs against `{reference}`'s at the same setting; exact tests, Holm over the "
        "per-setting rows (the pooled rows are unadjusted).\n\n"
    )
    header = ["setting", f"survived vs {reference}", "test", "p", "Holm p"]
    return head + markdown_table(header, rows) + "\n"


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of :func:`aggregate`'s rows."""
    header = ["setting", "mean [95% CI]", "diff vs reference [95% CI]", "verdict"]
    cells = []
    for r in rows:
        diff = (
            ""
            if r["diff"] is None
            else f"{r['diff']:+.4f} [{r['diff_low']:+.4f}, {r['diff_high']:+.4f}]"
        )
        mean = f"{r['mean']:.4f} [{r['low']:.4f}, {r['high']:.4f}]"
        cells.append([r["setting"], mean, diff, r["verdict"] or "reference"])
    return markdown_table(header, cells)


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


def _direction(spec: dict[str, Any], metric: str) -> bool | None:
    """True: higher is better; False: lower is better; None: signed (no better side)."""
    if metric in spec.get("higher_is_better", []):
        return True
    return None if metric in spec.get("signed", []) else False


def summarize(spec: dict[str, Any], out_dir: Path) -> str:
    """Write ``summary.md`` and the PNGs for every metric; return the markdown."""
    reference = spec.get("reference", next(iter(spec["targets"])))
    logs = _logs(spec, out_dir)  # read once for every metric and plot
    primary = check_primary(spec)
    margins = dict(spec.get("margins", {}))
    sections = []
    if primary is not None:
        margins.setdefault(primary["metric"], primary["margin"])
        scores = _scores(spec, logs, primary["metric"])
        higher = _direction(spec, primary["metric"])
        sections.append(primary_table(scores, primary, higher_is_better=higher))
    if spec.get("survival"):
        sections.append(survival_table(spec, logs))
    for metric in metrics(spec):
        higher = _direction(spec, metric)
        rows = aggregate(
            _scores(spec, logs, metric),
            reference,
            higher_is_better=higher,
            margin=margins.get(metric),
        )
        direction = {True: "higher is better", False: "lower is better", None: "signed"}[higher]
        kind = (
            "post hoc: chosen after results were seen"
            if metric in spec.get("post_hoc", [])
            else "secondary"
        )
        note = (
            f"{kind}; unadjusted 95% intervals; tie margin ±{margins[metric]:g}"
            if metric in margins
            else f"{kind}; unadjusted 95% intervals; no tie margin stated"
        )
        sections.append(f"### {metric} ({direction}; {note})\n\n{table(rows)}\n")
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
    check_primary(spec)
    run_grid(spec, args.out_dir, workers=args.workers)
    print(summarize(spec, args.out_dir))


if __name__ == "__main__":
    main()
