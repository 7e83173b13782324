"""The lag × learning-rate map of issue 30: where each configuration survives staleness, and learns.

Grid: configuration ({``recipe``: the counting recipe as it is, ``stable``: the recipe with the
candidate overlay ``configs/async_stable.yaml``, and the candidates declared after it,
:data:`CONFIGURATIONS`}) × value target ({GAE, BRACE}) × lag S
({0, 4, 8, 16}) × actor lr ({2.5e-5, 5e-5, 1e-4, 2e-4}) × warm start × seed. Each cell is one
``brace-lightning fit`` of the recipe (default ``configs/evidence/long_count.yaml``) with
``--data.init_args.lag S`` and ``--model.actor_optimizer.init_args.lr``, from a shared warm-started
actor: one per warm-start seed W (``OUT/warm<W>/``, the recipe's ``SupervisedWarmStart`` run once
with ``--seed_everything W``), whose own validation reward is measured once by ``brace-lightning
validate`` (``OUT/warm<W>/validate``). Cells run with the resume markers of
:func:`benchmarks.lm_staleness.run_marked` under ``OUT/cells/<config>/<target>/lag<S>/lr<lr>/
warm<W>/seed<N>/``. Each finished run also leaves a **record** under ``--records`` (default
``OUT/records``; docs/stability.md's maps keep theirs in ``docs/figures/lm_map/records/``, in
git): its :data:`RECORDED_TAGS` series as JSON with the machine it ran on and its warm start's
SHA-256; ``warm<W>.json`` the warm start's validation reward, and ``warm<W>/actor`` the
warm-started actor itself (about 2 MB), which a later machine copies in instead of training its
own (another CPU does not rebuild the same actor from the same seed). The map reads a run from its
folder where it ran under ``OUT``, else from its record, and does not run a recorded cell again: a
map outlives the machine its runs were on.

The outcomes are fixed before any cell runs (pre-registered in ``docs/stability.md``, 2026-12-06):

- **collapse**: at least ``--collapse-count`` (20) of the last ``--collapse-window`` (40) rollout
  batches have mean reward exactly 0 (:func:`collapsed`); a run that survives is one that did not
  collapse. Per map cell: survivors k of n runs, and the exact two-sided test of the candidate's
  count against the recipe's at the same (target, S, lr) (:func:`fisher_exact`);
- **learning**: the final-window validation reward (the mean of the last ``--val-window`` (2)
  ``val/reward`` passes, :func:`final_validation`) against the on-policy run's (S = 0, same
  configuration, target, lr, warm start and seed), paired; a run *learns* when its final-window
  validation reward is above its warm start's.

Writes ``OUT/map.md`` (a table per (configuration, target): survivors k/n and mean final
validation reward per (S, lr); the exact tests; the differences to S = 0) and ``OUT/map.png`` (one
panel per configuration and target, cells coloured by the surviving fraction and labelled with the
mean final validation reward). The full grid is 2 × 2 × 4 × 4 = 64 map cells per seed, about 20
CPU hours for 2 seeds on the counting recipe; screen with 2 seeds, then add seeds and warm starts
at the boundary cells (``--boundary``: the screen's cells on its boundary by the declared rule,
:func:`boundary_cells`, get the five runs of :data:`BOUNDARY_RUNS`, and ``OUT/map.md`` lists them
with why)::

    .venv/bin/python -m benchmarks.lm_staleness_map --out runs/lm_map --seeds 0 1 --warm-seeds 0
    .venv/bin/python -m benchmarks.lm_staleness_map --out runs/lm_map --seeds 0 1 --warm-seeds 0 --boundary
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import shutil
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import yaml

from benchmarks._common import CONFIGS, cli_command, fit_args, markdown_table, target_config
from benchmarks.lm_staleness import (
    RECIPE,
    lag_overrides,
    read_cell,
    run_marked,
    warm_start,
    window_mean,
)
from brace_lightning import statistics
from brace_lightning.callbacks import COLLAPSE_SIGNALS, CollapseWarning, warning_positions
from brace_lightning.sweep import copy_atomic, paired_difference, write_marker

LAGS = (0, 4, 8, 16)
LRS = (2.5e-5, 5e-5, 1e-4, 2e-4)
TARGETS = ("gae", "brace")
#: Configuration name -> overlays applied on top of the recipe (after the target's).
CONFIGURATIONS: dict[str, tuple[Path, ...]] = {
    "recipe": (),
    "stable": (CONFIGS / "async_stable.yaml",),
    # The second candidate (declared 2026-12-06 after the first collapsed at S = 8, lr 2e-4):
    # the first plus ρ = min(ρ̄, π/µ) in the actor's advantage.
    "stable_rho": (CONFIGS / "async_stable.yaml", CONFIGS / "targets" / "rho_in_advantage.yaml"),
    # The third (declared 2026-12-06 after the second collapsed at S = 8, lr 2e-4): the second
    # with the actor's lr capped by the batch's staleness, S̄ · lr ≤ 8e-4 (the product at which the
    # second survived). Where S · lr ≤ 8e-4 it trains bit for bit as the second.
    "stable_budget": (
        CONFIGS / "async_stable.yaml",
        CONFIGS / "targets" / "rho_in_advantage.yaml",
        CONFIGS / "staleness_step_size.yaml",
    ),
    # The fourth (declared 2026-12-06 21:17 UTC after the third survived S = 8, lr 2e-4 in 6/6 runs
    # but learned in 1/6): the third with half its budget, S̄ · lr ≤ 4e-4 (OVERRIDES), so a batch
    # 8 versions old trains the actor at 5e-5, the lr at which the stale runs that learned ran.
    "stable_budget_4e-4": (
        CONFIGS / "async_stable.yaml",
        CONFIGS / "targets" / "rho_in_advantage.yaml",
        CONFIGS / "staleness_step_size.yaml",
    ),
}
#: The fourth candidate's staleness budget (versions × learning rate).
HALF_BUDGET = 4e-4
#: Configuration -> CLI overrides after its overlays (a setting an overlay file does not carry).
OVERRIDES: dict[str, tuple[str, ...]] = {
    "stable_budget_4e-4": (f"--model.actor_step_size.init_args.lr_budget={HALF_BUDGET}",),
}
COLLAPSE_WINDOW, COLLAPSE_COUNT, VAL_WINDOW = 40, 20, 2
#: The logged series a run's record keeps (:func:`write_record`): what the outcomes read, the
#: collapse warning's signals and the diagnostics of docs/stability.md's runs tables.
RECORDED_TAGS = (
    "rollout/reward",
    "val/reward",
    *(signal.key for signal in COLLAPSE_SIGNALS.values()),
    "lr/actor_scale",
    "actor/skipped_equal_reward",
)
#: A run's logged scalars: tag -> (step, value) pairs.
Series = dict[str, list[tuple[int, float]]]
#: A finished run's scalar series, read from its event file once per process: the outcomes and the
#: warning replay read the same runs, and a configuration's SAME_RUNS cells are another's runs.
read_series = functools.cache(read_cell)

#: The runs a boundary cell gets (docs/stability.md, declared 2026-12-07): seeds 0–2 of warm start
#: 0 and seeds 0–1 of warm start 1, as (warm start, seed); the screen's two are the first two.
BOUNDARY_RUNS = ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1))
#: A map cell without its warm start and seed: (configuration, target, lag, lr).
CellKey = tuple[str, str, int, float]


def _staleness_budget() -> float:
    """``lr_budget`` of ``configs/staleness_step_size.yaml`` (the one place it is set)."""
    overlay = yaml.safe_load((CONFIGS / "staleness_step_size.yaml").read_text())
    return float(overlay["model"]["actor_step_size"]["init_args"]["lr_budget"])


#: Configuration -> (the configuration it trains bit for bit as, the S · lr up to which it does).
#: ``stable_budget`` is ``stable_rho`` plus a staleness factor that is exactly 1 while S̄ · lr ≤ its
#: budget (``step_size.StalenessAdaptiveStepSize``; S̄ ≤ S at a fixed lag), so its cells there are
#: ``stable_rho``'s runs, read (and run) once.
SAME_RUNS: dict[str, tuple[str, float]] = {
    "stable_budget": ("stable_rho", _staleness_budget()),
    "stable_budget_4e-4": ("stable_rho", HALF_BUDGET),
}


@dataclass(frozen=True)
class MapCell:
    """One run of the map."""

    config: str
    target: str
    lag: int
    lr: float
    warm: int
    seed: int

    def __str__(self) -> str:
        return f"{self.config}/{self.target}/lag{self.lag}/lr{self.lr:g}/warm{self.warm}/seed{self.seed}"

    def folder(self, out: Path) -> Path:
        """Where the cell's run writes its events and its ``done.json`` marker (that of
        :meth:`same_run`)."""
        return out / "cells" / Path(str(self.same_run()))

    def same_run(self) -> MapCell:
        """The cell whose run this one is: itself, or where its configuration trains bit for bit
        as another (:data:`SAME_RUNS`), that configuration's cell."""
        same = SAME_RUNS.get(self.config)
        if same is not None and self.lag * self.lr <= same[1]:
            return dataclasses.replace(self, config=same[0])
        return self


def map_grid(
    configs: Sequence[str],
    targets: Sequence[str],
    lags: Sequence[int],
    lrs: Sequence[float],
    warms: Sequence[int],
    seeds: Sequence[int],
) -> list[MapCell]:
    """Cells in run order: warm start and seed outermost (a grid stopped early holds whole
    seeds), then configuration, target, lag and lr."""
    return [
        MapCell(config, target, lag, lr, warm, seed)
        for warm in warms
        for seed in seeds
        for config in configs
        for target in targets
        for lag in lags
        for lr in lrs
    ]


def warm_folder(out: Path, warm: int) -> Path:
    """The shared warm start of warm-start seed ``warm`` (``warm_start``'s output folder)."""
    return out / f"warm{warm}"


def map_command(
    cell: MapCell, out: Path, *, steps: int, every: int, recipe: Path, extra: Sequence[str]
) -> list[str]:
    """The ``brace-lightning fit`` command of ``cell``: the recipe, the target's overlay, the
    configuration's overlays, then lag, lr, seeds and the shared warm-started actor."""
    args = fit_args(
        recipe,
        target_config(cell.target),
        *CONFIGURATIONS[cell.config],
        seed=cell.seed,
        data_seed=cell.seed,
        callbacks=False,
        log_dir=cell.folder(out),
        run_name="tb",
        overrides=[
            f"--model.actor={warm_folder(out, cell.warm) / 'warm_start' / 'actor'}",
            f"--model.actor_optimizer.init_args.lr={cell.lr}",
            *lag_overrides(lag=cell.lag, seed=cell.seed, steps=steps, every=every),
            *OVERRIDES.get(cell.config, ()),
            *extra,
        ],
    )
    return cli_command(args)


def warm_sha256(out: Path, warm: int) -> str | None:
    """SHA-256 of warm start ``warm``'s actor weights under ``out`` (None before it exists)."""
    path = warm_folder(out, warm) / "warm_start" / "actor" / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def machine() -> str:
    """The CPU model and core count of this machine (what a run's numbers depend on besides its
    seeds: kernels differ between CPUs, so runs are bit for bit the same only on the same one)."""
    models = [
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    ] if Path("/proc/cpuinfo").exists() else []  # fmt: skip
    return f"{models[0] if models else platform.machine()}, {os.cpu_count()} cores"


def pin_warm_start(out: Path, warm: int, records: Path) -> None:
    """Pin warm start ``warm`` in ``records/warm<W>/actor`` (the exported Hugging Face folder):
    copy a recorded one into ``out`` where ``out`` has none, or record the one ``out`` has.

    Raises:
        SystemExit: when ``out`` holds a different warm start ``warm`` than ``records``.
    """
    folder = warm_folder(out, warm)
    actor, kept = folder / "warm_start" / "actor", records / f"warm{warm}" / "actor"
    if (kept / "config.json").exists():
        if not (actor / "config.json").exists():
            shutil.rmtree(actor, ignore_errors=True)
            copy_atomic(kept, actor)
        elif (actor / "model.safetensors").read_bytes() != (
            kept / "model.safetensors"
        ).read_bytes():
            raise SystemExit(
                f"warm start {warm} in {folder} is not the one recorded in {kept}; use a new "
                "--out (the recorded one is then used) or another --records."
            )
    elif (actor / "config.json").exists():
        copy_atomic(actor, kept)


def prepare_warm_start(
    out: Path, warm: int, recipe: Path, extra: Sequence[str], records: Path | None = None
) -> str:
    """Warm start ``warm`` (once) and its validation reward (once, ``brace-lightning validate``
    of the warm-started actor on the recipe's validation prompts); the validate run's status.

    With ``records``, the warm start is pinned there (:func:`pin_warm_start`): a recorded one is
    copied in instead of trained, since another CPU does not rebuild the same actor from the same
    seed, and one trained here is recorded.
    """
    folder = warm_folder(out, warm)
    if records is not None:
        pin_warm_start(out, warm, records)
    warm_start(folder, recipe, [f"--seed_everything={warm}", *extra])
    if records is not None:
        pin_warm_start(out, warm, records)
    args = [
        "validate",
        "--config",
        str(recipe),
        "--trainer.callbacks=[]",
        f"--seed_everything={warm}",
        f"--model.actor={folder / 'warm_start' / 'actor'}",
        f"--trainer.logger.init_args.save_dir={folder / 'validate'}",
        "--trainer.logger.init_args.name=tb",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        *extra,
    ]
    return run_marked(folder / "validate", cli_command(args), {"warm": warm})


def record_file(records: Path, cell: MapCell) -> Path:
    """Where the record of ``cell``'s run lives: one JSON per run (that of
    :meth:`MapCell.same_run`), in a folder meant to be committed with the results."""
    return records / f"{cell.same_run()}.json"


def write_record(records: Path, cell: MapCell, out: Path) -> None:
    """Keep what the map reads of ``cell``'s finished run: its :data:`RECORDED_TAGS` series and
    its seconds, so the map outlives the machine the run's event files are on."""
    folder = cell.folder(out)
    series = read_series(folder)
    seconds = json.loads((folder / "done.json").read_text()).get("seconds")
    payload = {
        "cell": dataclasses.asdict(cell.same_run()),
        "seconds": seconds,
        "machine": machine(),
        "warm_sha256": warm_sha256(out, cell.warm),
        "series": {tag: series[tag] for tag in RECORDED_TAGS if tag in series},
    }
    write_marker(record_file(records, cell), payload)


@functools.cache
def _load_record(path: Path) -> Series:
    series = json.loads(path.read_text())["series"]
    return {
        tag: [(int(step), float(value)) for step, value in points] for tag, points in series.items()
    }


def run_series(cell: MapCell, out: Path, records: Path) -> Series | None:
    """The logged series of ``cell``'s finished run: from its run folder where it ran under
    ``out`` (recording it first if ``records`` has no record of it; a record that disagrees with
    the run is reported and the run is read), else from its record; None when it has neither."""
    path = record_file(records, cell)
    if (cell.folder(out) / "done.json").exists():
        if not path.exists():
            write_record(records, cell, out)
        series = read_series(cell.folder(out))
        kept = {tag: series[tag] for tag in RECORDED_TAGS if tag in series}
        if kept != _load_record(path):
            print(f"{cell}: the run in {out} differs from its record {path}; the run is read")
        return series
    return _load_record(path) if path.exists() else None


def run_seconds(cell: MapCell, out: Path, records: Path) -> float | None:
    """The wall-clock seconds of ``cell``'s finished run (one torch thread): from its marker where
    it ran under ``out``, else from its record; None when it has neither."""
    marker, path = cell.folder(out) / "done.json", record_file(records, cell)
    for source in (marker, path):
        if source.exists():
            seconds = json.loads(source.read_text()).get("seconds")
            return None if seconds is None else float(seconds)
    return None


def cost_table(cells: Sequence[MapCell], out: Path, records: Path) -> str:
    """Markdown: where the map's CPU time went, per (configuration, target) the finished runs
    (each shared run once, :meth:`MapCell.same_run`), their summed hours and median minutes."""
    runs = {cell: cell.same_run() for cell in cells}
    seconds: dict[tuple[str, str], list[float]] = {}
    for run in dict.fromkeys(runs.values()):
        value = run_seconds(run, out, records)
        if value is not None:
            seconds.setdefault((run.config, run.target), []).append(value)
    rows = [
        [config, target, len(values), f"{sum(values) / 3600:.1f}", f"{median(values) / 60:.1f}"]
        for (config, target), values in sorted(seconds.items())
    ]
    every = [value for values in seconds.values() for value in values]
    if every:
        rows.append(
            ["all", "", len(every), f"{sum(every) / 3600:.1f}", f"{median(every) / 60:.1f}"]
        )
    header = ["runs of", "target", "runs", "CPU hours", "median minutes"]
    text = "**CPU time of the runs read (one torch thread each)**\n\n" + markdown_table(
        header, rows
    )
    stands_for: dict[str, set[str]] = {}
    for cell, run in runs.items():
        if run.config != cell.config and (run.config, run.target) in seconds:
            stands_for.setdefault(run.config, set()).add(cell.config)
    for config, served in sorted(stands_for.items()):
        text += (
            f"\n\n`{config}`'s runs here are also the cells of {', '.join(sorted(served))} "
            "that train bit for bit as them (SAME_RUNS); each is counted once."
        )
    return text


def recorded_elsewhere(cell: MapCell, out: Path, records: Path) -> bool:
    """Whether ``cell``'s run has a record but did not run under ``out`` (it is not run again)."""
    return record_file(records, cell).exists() and not (cell.folder(out) / "done.json").exists()


def warm_validation(out: Path, warm: int, records: Path | None = None) -> float:
    """The warm start's validation reward: from its ``validate`` run under ``out`` (kept in
    ``records/warm<W>.json`` too), else from that record; NaN when it has neither."""
    folder = warm_folder(out, warm) / "validate"
    record = None if records is None else records / f"warm{warm}.json"
    if (folder / "done.json").exists():
        value = window_mean(read_cell(folder)["val/reward"], 1)
        if record is not None and not record.exists():
            payload = {"warm": warm, "val/reward": value, "sha256": warm_sha256(out, warm)}
            write_marker(record, {**payload, "machine": machine()})
        return value
    if record is not None and record.exists():
        return float(json.loads(record.read_text())["val/reward"])
    return math.nan


def collapsed(
    rewards: list[tuple[int, float]], *, window: int = COLLAPSE_WINDOW, count: int = COLLAPSE_COUNT
) -> bool:
    """The pre-registered collapse: at least ``count`` of the last ``window`` rollout batches (by
    step) have mean reward exactly 0."""
    return zero_batches(rewards, window) >= count


def zero_batches(rewards: list[tuple[int, float]], window: int = COLLAPSE_WINDOW) -> int:
    """How many of the last ``window`` rollout batches (by step) have mean reward exactly 0."""
    return sum(value == 0.0 for _, value in sorted(rewards)[-window:])


def final_validation(val_rewards: list[tuple[int, float]], window: int = VAL_WINDOW) -> float:
    """The pre-registered learning outcome: the mean of the last ``window`` validation passes."""
    return window_mean(val_rewards, window)


def fisher_exact(table: tuple[tuple[int, int], tuple[int, int]]) -> float:
    """Two-sided p-value of Fisher's exact test of a 2×2 table ``((a, b), (c, d))``: the summed
    probability, under fixed margins, of every table no more likely than the observed one
    (the rule of R's ``fisher.test`` and SciPy's ``fisher_exact``; :func:`statistics.fisher_exact`)."""
    (a, b), (c, d) = table
    if min(a, b, c, d) < 0:
        raise ValueError(f"table must hold counts >= 0; got {table!r}.")
    return statistics.fisher_exact(a, b, c, d)


@dataclass
class Outcome:
    """The pre-registered outcomes of one finished run."""

    survived: bool
    final_val: float


def read_outcomes(
    cells: Sequence[MapCell],
    out: Path,
    records: Path,
    *,
    collapse_window: int,
    collapse_count: int,
    val_window: int,
) -> tuple[dict[MapCell, Outcome], dict[MapCell, Series], list[MapCell]]:
    """The outcome and the logged series of every finished cell (run under ``out`` or recorded
    in ``records``, :func:`run_series`), and the cells with neither (missing)."""
    outcomes, logged, missing = {}, {}, []
    for cell in cells:
        series = run_series(cell, out, records)
        if series is None:
            missing.append(cell)
            continue
        survived = not collapsed(
            series["rollout/reward"], window=collapse_window, count=collapse_count
        )
        outcomes[cell] = Outcome(survived, final_validation(series["val/reward"], val_window))
        logged[cell] = series
    return outcomes, logged, missing


def first_warnings(series: Series, watch: CollapseWarning) -> dict[str, int | None]:
    """Per signal ``watch`` watches (``COLLAPSE_SIGNALS``' threshold names), the rollout step at
    which it would first have warned on a recorded run's ``series``, or None: the callback's own
    rule (:func:`brace_lightning.callbacks.warning_positions`) replayed on the logged values."""
    first: dict[str, int | None] = {}
    for name, threshold in watch.thresholds.items():
        logged = sorted(series.get(COLLAPSE_SIGNALS[name].key, []))
        positions = warning_positions([v for _, v in logged], threshold, watch.patience)
        first[name] = logged[positions[0]][0] if positions else None
    return first


def warning_table(
    outcomes: dict[MapCell, Outcome],
    warnings: dict[MapCell, dict[str, int | None]],
    watch: CollapseWarning,
) -> str:
    """Markdown, post hoc: per configuration, how many collapsed and how many surviving runs each
    signal of ``watch`` would have warned on (``warnings``: :func:`first_warnings` per run), and
    the median step of its first warning in the collapsed runs."""
    rows = []
    for config in sorted({cell.config for cell in outcomes}):
        cells = [cell for cell in outcomes if cell.config == config]
        down = [cell for cell in cells if not outcomes[cell].survived]
        alive = [cell for cell in cells if outcomes[cell].survived]
        row: list[Any] = [config, len(down), len(alive)]
        for name in watch.thresholds:
            steps = [s for c in down if (s := warnings[c].get(name)) is not None]
            false = sum(warnings[c].get(name) is not None for c in alive)
            middle = f", median step {median(steps):g}" if steps else ""
            row.append(f"{len(steps)}/{len(down)}{middle}; survivors {false}/{len(alive)}")
        rows.append(row)
    header = ["configuration", "collapsed", "survived"]
    header += [f"{COLLAPSE_SIGNALS[n].key} > {t:g}" for n, t in watch.thresholds.items()]
    return (
        f"**the CollapseWarning defaults (patience {watch.patience}) replayed on every run, post "
        "hoc: the collapsed runs and the survivors each signal would have warned on** (a "
        "configuration's cells that are another's runs, SAME_RUNS, count in both rows)\n\n"
        + markdown_table(header, rows)
    )


def _mean_text(values: list[tuple[int, float]], window: int) -> str:
    """The mean of the last ``window`` values to 3 decimals (:func:`window_mean`), ``-`` when
    there is none; one that rounds to zero prints as 0.000, also a tiny negative one (k3 KL on
    fresh batches)."""
    if not values:
        return "-"
    mean = window_mean(values, window)
    return f"{mean:.3f}" if round(mean, 3) != 0 else "0.000"


def runs_table(
    outcomes: dict[MapCell, Outcome],
    series: dict[MapCell, Series],
    warm_rewards: dict[int, float],
    window: int = COLLAPSE_WINDOW,
) -> str:
    """Markdown, one row per run: its pre-registered outcomes (collapsed, final validation,
    learned: above its warm start's validation, with the margin) and, post hoc, over its last
    ``window`` rollout steps, the batches at reward 0, the mean k3 KL(µ‖π), the mean actor lr
    factor (``lr/actor_scale``; 1 without a step-size rule) and the steps the equal-reward rule
    took the actor's step from (over the whole run)."""
    rows = []
    for cell in sorted(outcomes, key=lambda c: (c.config, c.target, c.lag, c.lr, c.warm, c.seed)):
        outcome, logged = outcomes[cell], series[cell]
        margin = outcome.final_val - warm_rewards.get(cell.warm, math.nan)
        learned = (
            "n/a" if math.isnan(margin) else f"{'yes' if margin > 0 else 'no'} ({margin:+.3f})"
        )
        zeros = zero_batches(logged["rollout/reward"], window)
        k3 = _mean_text(logged.get("kl/mu_pi_k3", []), window)
        scale = logged.get("lr/actor_scale", [])
        skipped = sum(value for _, value in logged.get("actor/skipped_equal_reward", []))
        rows.append(
            [cell.config, cell.target, cell.lag, f"{cell.lr:g}", cell.warm, cell.seed]
            + ["no" if outcome.survived else "yes", f"{outcome.final_val:.3f}", learned, zeros]
            + [k3, f"{window_mean(scale, window):.2f}" if scale else "1"]
            + [f"{skipped:g}"]
        )
    header = ["configuration", "target", "S", "actor lr", "warm", "seed", "collapsed"]
    header += ["final val", "learned", f"zero batches, last {window}", f"k3 KL, last {window}"]
    header += [f"lr factor, last {window}", "steps without an actor step"]
    return (
        f"**every run: its outcomes, then (post hoc) its last {window} steps**\n\n"
        + markdown_table(header, rows)
    )


def _key(cell: MapCell) -> CellKey:
    return cell.config, cell.target, cell.lag, cell.lr


def map_tables(outcomes: dict[MapCell, Outcome], warm_rewards: dict[int, float]) -> str:
    """Markdown: per (configuration, target) a lag × lr table of survivors k/n, the mean final
    validation reward and how many runs learned (above their warm start); the exact tests of
    ``stable`` against ``recipe``; the paired difference of final validation reward to S = 0."""
    groups: dict[tuple[str, str, int, float], list[tuple[MapCell, Outcome]]] = {}
    for cell, outcome in outcomes.items():
        groups.setdefault(_key(cell), []).append((cell, outcome))
    sections = []
    panels = sorted({(config, target) for config, target, _, _ in groups})
    lags = sorted({lag for _, _, lag, _ in groups})
    lrs = sorted({lr for _, _, _, lr in groups})
    for config, target in panels:
        rows = []
        for lag in lags:
            row: list[Any] = [lag]
            for lr in lrs:
                runs = groups.get((config, target, lag, lr), [])
                if not runs:
                    row.append("-")
                    continue
                alive = sum(o.survived for _, o in runs)
                learned = sum(o.final_val > warm_rewards.get(c.warm, math.inf) for c, o in runs)
                mean = sum(o.final_val for _, o in runs) / len(runs)
                row.append(f"{alive}/{len(runs)} alive, val {mean:.3f}, {learned} learned")
            rows.append(row)
        header = ["S \\ actor lr", *(f"{lr:g}" for lr in lrs)]
        sections.append(f"**{config}, {target}**\n\n" + markdown_table(header, rows))
    tests = []
    for config, target, lag, lr in sorted(groups):
        if config == "recipe" or ("recipe", target, lag, lr) not in groups:
            continue
        counts = []
        for name in (config, "recipe"):
            runs = groups[(name, target, lag, lr)]
            alive = sum(o.survived for _, o in runs)
            counts.append((alive, len(runs) - alive))
        p = fisher_exact((counts[0], counts[1]))
        tests.append(
            [config, target, lag, f"{lr:g}", f"{counts[0][0]}/{sum(counts[0])}"]
            + [f"{counts[1][0]}/{sum(counts[1])}", f"{p:.3g}"]
        )
    if tests:
        header = ["candidate", "target", "S", "actor lr", "alive", "recipe alive", "Fisher exact p"]
        sections.append(
            "**survival, each candidate vs the recipe at the same cell**\n\n"
            + markdown_table(header, tests)
        )
    diffs = []
    for (config, target, lag, lr), runs in sorted(groups.items()):
        on_policy = groups.get((config, target, 0, lr))
        if lag == 0 or not on_policy:
            continue
        by_run = {(c.warm, c.seed): o.final_val for c, o in runs}
        reference = {(c.warm, c.seed): o.final_val for c, o in on_policy}
        shared = set(by_run) & set(reference)
        if len(shared) < 2:
            continue
        d, low, high, verdict = paired_difference(by_run, reference, higher_is_better=True)
        diffs.append(
            [
                config,
                target,
                lag,
                f"{lr:g}",
                len(shared),
                f"{d:+.3f} [{low:+.3f}, {high:+.3f}]",
                verdict,
            ]
        )
    if diffs:
        header = ["config", "target", "S", "actor lr", "runs", "Δ final val vs S = 0", "verdict"]
        sections.append(
            "**learning, against the on-policy run**\n\n" + markdown_table(header, diffs)
        )
    return "\n\n".join(sections)


def boundary_cells(
    outcomes: dict[MapCell, Outcome],
    screen: Sequence[MapCell],
) -> tuple[dict[CellKey, str], list[CellKey]]:
    """The screen's boundary by the rule declared with it (docs/stability.md, 2026-12-07).

    A cell of a (configuration, target) panel is on the boundary when its screen runs split (some
    but not all survived), or when all of them survived and the next cell up along S (same lr) or
    along lr (same S) had all of its screen runs collapse. Returns the boundary cells with the
    reason, and the cells the rule cannot decide yet (a screen run of the cell, or of a neighbour
    it needs, is missing)."""
    runs: dict[CellKey, list[MapCell]] = {}
    for cell in screen:
        runs.setdefault(_key(cell), []).append(cell)
    lags = sorted({lag for _, _, lag, _ in runs})
    lrs = sorted({lr for _, _, _, lr in runs})

    def alive(key: CellKey) -> int | None:
        """Survivors among the screen runs of ``key``; None while one of them is missing."""
        if any(cell not in outcomes for cell in runs[key]):
            return None
        return sum(outcomes[cell].survived for cell in runs[key])

    boundary: dict[CellKey, str] = {}
    undecided: list[CellKey] = []
    for key in runs:
        config, target, lag, lr = key
        k, n = alive(key), len(runs[key])
        if k is None:
            undecided.append(key)
            continue
        if 0 < k < n:
            boundary[key] = f"split ({k}/{n} survived)"
            continue
        if k == 0:
            continue
        reasons, unknown = [], False
        for name, up in (
            ("S", (config, target, lags[lags.index(lag) + 1], lr) if lag != lags[-1] else None),
            ("lr", (config, target, lag, lrs[lrs.index(lr) + 1]) if lr != lrs[-1] else None),
        ):
            if up is None or up not in runs:
                continue
            up_alive = alive(up)
            if up_alive is None:
                unknown = True
            elif up_alive == 0:
                reasons.append(f"the next {name} up (S = {up[2]}, lr {up[3]:g}) collapsed")
        if reasons:
            boundary[key] = "; ".join(reasons)
        elif unknown:
            undecided.append(key)
    return boundary, undecided


def boundary_grid(boundary: Sequence[CellKey]) -> list[MapCell]:
    """The runs of the boundary cells (:data:`BOUNDARY_RUNS`), in run order: warm start and seed
    outermost, as :func:`map_grid`."""
    return [
        MapCell(config, target, lag, lr, warm, seed)
        for warm, seed in BOUNDARY_RUNS
        for config, target, lag, lr in sorted(boundary)
    ]


def boundary_table(boundary: dict[CellKey, str], undecided: Sequence[CellKey]) -> str:
    """Markdown: the boundary cells with why, then the cells the rule cannot decide yet."""
    rows = [[c, t, lag, f"{lr:g}", why] for (c, t, lag, lr), why in sorted(boundary.items())]
    text = "**boundary cells (the declared rule, read from the screen's runs)**\n\n"
    text += markdown_table(["config", "target", "S", "actor lr", "why"], rows) if rows else "none"
    panels = Counter((config, target) for config, target, _, _ in undecided)
    if panels:
        counts = ", ".join(f"{c}/{t}: {n}" for (c, t), n in sorted(panels.items()))
        text += f"\n\ncells not decided yet (a screen run they need is missing): {counts}"
    return text


def map_figure(outcomes: dict[MapCell, Outcome], path: Path) -> None:
    """PNG: one panel per (configuration, target); rows lag S, columns actor lr; each cell
    coloured by the fraction of its runs that survived (red 0 → green 1) and labelled with the
    mean final validation reward and k/n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c.config, c.target) for c in outcomes})
    lags = sorted({c.lag for c in outcomes})
    lrs = sorted({c.lr for c in outcomes})
    fig, axes = plt.subplots(
        1, len(panels), figsize=(1.2 + 1.3 * len(lrs) * len(panels), 1.0 + 0.9 * len(lags)),
        squeeze=False,
    )  # fmt: skip
    for ax, (config, target) in zip(axes[0], panels, strict=True):
        fraction = [[math.nan] * len(lrs) for _ in lags]
        for i, lag in enumerate(lags):
            for j, lr in enumerate(lrs):
                runs = [o for c, o in outcomes.items() if _key(c) == (config, target, lag, lr)]
                if not runs:
                    continue
                alive = sum(o.survived for o in runs)
                fraction[i][j] = alive / len(runs)
                mean = sum(o.final_val for o in runs) / len(runs)
                ax.text(
                    j, i, f"{mean:.2f}\n{alive}/{len(runs)}", ha="center", va="center", fontsize=8
                )
        ax.imshow(fraction, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
        ax.set_yticks(range(len(lags)), [str(lag) for lag in lags])
        ax.set_xlabel("actor lr")
        ax.set_ylabel("lag S")
        ax.set_title(f"{config}, {target}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_missing(cells: Sequence[MapCell], args: argparse.Namespace, records: Path) -> None:
    """Run the cells not run or recorded yet (each shared run once, ``--workers`` at a time),
    after the warm starts they start from; each finished run leaves its record."""
    runs = []
    for cell in dict.fromkeys(cell.same_run() for cell in cells):  # each run once
        if recorded_elsewhere(cell, args.out, records):
            print(f"{cell}: recorded", flush=True)
        else:
            runs.append(cell)
    for warm in dict.fromkeys(cell.warm for cell in runs):  # only those a run starts from
        status = prepare_warm_start(args.out, warm, args.config, args.extra, records)
        print(f"warm start {warm}: validation {status}", flush=True)
    run = functools.partial(
        map_command, out=args.out, steps=args.steps, every=args.every, recipe=args.config,
        extra=args.extra,
    )  # fmt: skip

    def one(cell: MapCell) -> None:
        status = run_marked(cell.folder(args.out), run(cell), {"cell": cell.__dict__})
        if status == "done":
            write_record(records, cell, args.out)
        print(f"{cell}: {status}", flush=True)

    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(one, runs))


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: prepare the warm starts, run the missing cells, then write the map."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder (reused to resume)")
    parser.add_argument(
        "--configs", nargs="+", default=list(CONFIGURATIONS), choices=list(CONFIGURATIONS)
    )
    parser.add_argument("--targets", nargs="+", default=list(TARGETS))
    parser.add_argument("--lags", type=int, nargs="+", default=list(LAGS))
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    parser.add_argument("--warm-seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=200, help="rollout steps per cell")
    parser.add_argument("--every", type=int, default=20, help="validate every this many steps")
    parser.add_argument("--collapse-window", type=int, default=COLLAPSE_WINDOW)
    parser.add_argument("--collapse-count", type=int, default=COLLAPSE_COUNT)
    parser.add_argument("--val-window", type=int, default=VAL_WINDOW)
    parser.add_argument("--workers", type=int, default=1, help="cells run at the same time")
    parser.add_argument("--config", type=Path, default=RECIPE, help="the recipe")
    parser.add_argument(
        "--records",
        type=Path,
        default=None,
        help="where each finished run's record goes and is read from: a run recorded there is "
        "not run again (default: OUT/records; the docs' maps use docs/figures/lm_map/records)",
    )
    parser.add_argument(
        "--boundary",
        action="store_true",
        help="read the grid as the screen and give each cell on its boundary (the rule of "
        "docs/stability.md, boundary_cells) the runs of BOUNDARY_RUNS: seeds 0-2 of warm start "
        "0 and 0-1 of warm start 1",
    )
    parser.add_argument("--aggregate-only", action="store_true", help="run no cell")
    parser.add_argument("extra", nargs="*", help="more CLI overrides for every run, after --")
    args = parser.parse_args(argv)
    if args.steps < args.every or args.steps % args.every:
        parser.error(f"--steps ({args.steps}) must be a multiple of --every ({args.every}).")
    if not 0 < args.collapse_count <= args.collapse_window:
        parser.error(
            f"--collapse-count must be in [1, --collapse-window={args.collapse_window}]; "
            f"got {args.collapse_count}."
        )
    if args.workers < 1:
        parser.error(f"--workers must be >= 1; got {args.workers}.")
    cells = map_grid(args.configs, args.targets, args.lags, args.lrs, args.warm_seeds, args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    records = args.records if args.records is not None else args.out / "records"
    if not args.aggregate_only:
        run_missing(cells, args, records)
    boundary: dict[CellKey, str] = {}
    undecided: list[CellKey] = []
    if args.boundary:  # the screen's boundary cells get their runs (BOUNDARY_RUNS)
        screen, _, _ = read_outcomes(
            cells, args.out, records, collapse_window=args.collapse_window,
            collapse_count=args.collapse_count, val_window=args.val_window,
        )  # fmt: skip
        boundary, undecided = boundary_cells(screen, cells)
        known = set(cells)
        added = [cell for cell in boundary_grid(list(boundary)) if cell not in known]
        if not args.aggregate_only:
            run_missing(added, args, records)
        cells += added
    outcomes, series, missing = read_outcomes(
        cells, args.out, records, collapse_window=args.collapse_window,
        collapse_count=args.collapse_count, val_window=args.val_window,
    )  # fmt: skip
    warms = sorted({cell.warm for cell in cells})
    for warm in warms:
        if warm_sha256(args.out, warm) is not None:  # a warm start here is recorded too
            pin_warm_start(args.out, warm, records)
    warm_rewards = {warm: warm_validation(args.out, warm, records) for warm in warms}
    text = map_tables(outcomes, warm_rewards)
    if args.boundary:
        text += "\n\n" + boundary_table(boundary, undecided)
    if outcomes:
        watch = CollapseWarning()
        warnings = {cell: first_warnings(series[cell], watch) for cell in outcomes}
        text += "\n\n" + warning_table(outcomes, warnings, watch)
        text += "\n\n" + runs_table(outcomes, series, warm_rewards)
    text += "\n\n" + cost_table(cells, args.out, records)
    (args.out / "map.md").write_text(text + "\n")
    (args.out / "outcomes.json").write_text(
        json.dumps([{**c.__dict__, **o.__dict__} for c, o in outcomes.items()], indent=1)
    )
    if outcomes:
        map_figure(outcomes, args.out / "map.png")
    print(text)
    if missing:
        print(f"missing cells ({len(missing)}): " + ", ".join(str(c) for c in missing))


if __name__ == "__main__":
    main()
