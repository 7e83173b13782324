"""Step time of the quickstart model with each value target, and the value target's share of it.

    python -m benchmarks.train_step [--steps 12] [--repeats 3] [--targets gae vtrace brace]
    python -m benchmarks.train_step --packing [--steps 12] [--repeats 3]

Each run is the quickstart recipe without the warm start (random tiny model, fixed lag 2), timed
per training step (generation + log-probs + values + value target + PPO update). For every target
we report the median step time, the median time of the value-target call (logged by the module as
``time/value_target_ms``) and its share of the step. The overhead of BRACE over GAE is the
difference of the value-target medians divided by GAE's median step time (paper: +1.5% step time
for BRACE over uncorrected asynchronous PPO). Runs alternate between targets so that machine load
affects them alike. ``--targets`` names other ``configs/targets/*.yaml`` overlays; the first is
the baseline of the overhead column (``--targets grpo grpo_opob``: the cost of VCPO's optimal
baseline, whose per-response backward passes ``time/value_target_ms`` includes).

``--packing`` times the quickstart (BRACE) with padded micro-batches against packed ones
(``pack_sequences``): packed with the row-by-row SDPA the trainer switches to
(``models/packing.py``, ``VARLEN_SDPA``), and packed with plain SDPA and its dense block-diagonal
``N × N`` mask (the trainer before ``VARLEN_SDPA``). It reports the medians of the step, of the PPO
update (``time/update_ms``) and of the scoring forwards (``time/old_forward_ms``), and the ratios
of the step to the padded one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import torch

from benchmarks._common import QUICKSTART, fit_args, markdown_table, target_config
from brace_lightning.cli import run
from brace_lightning.logs import read_scalars

TARGETS = ["gae", "vtrace", "brace"]


class StepTimer(pl.Callback):
    """Wall time of every training step (the rollout batch is generated inside the step)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.seconds.append(time.perf_counter() - self._start)


def one_run(
    target: str, steps: int, root: Path, extra: tuple[str, ...] = (), name: str | None = None
) -> tuple[list[float], dict[str, list[float]]]:
    """(step seconds, logged ``time/*`` ms) of every step after the first of one run."""
    timer = StepTimer()
    trainer_args = fit_args(
        QUICKSTART,
        target_config(target),
        steps=steps,
        callbacks=False,
        log_dir=root,
        run_name=name or target,
        overrides=["--model.critic_warmup_steps=0", *extra],
    )
    cli = run(trainer_args, trainer_defaults={"callbacks": [timer]})
    scalars = read_scalars(cli.trainer.logger.log_dir)
    times = {
        key: [value for _, value in series][1:]
        for key, series in scalars.items()
        if key.startswith("time/")
    }
    return timer.seconds[1:], times


#: ``--packing``'s cases: name → (extra CLI arguments, packed rows keep plain SDPA's dense mask).
PACKING_CASES = {
    "padded": (("--model.pack_sequences=false",), False),
    "packed, row-by-row SDPA": (("--model.pack_sequences=true",), False),
    "packed, dense N × N mask": (("--model.pack_sequences=true",), True),
}


#: The series ``--packing`` collects per case: the step's wall seconds and two logged timings.
PACKING_SERIES = ("step", "time/update_ms", "time/old_forward_ms")


def packing_table(steps: int, repeats: int, root: Path) -> None:
    """Print the step, update and scoring-forward medians of :data:`PACKING_CASES`."""
    series: dict[str, dict[str, list[float]]] = {
        case: {key: [] for key in PACKING_SERIES} for case in PACKING_CASES
    }
    for _ in range(repeats):
        for index, (case, (extra, dense)) in enumerate(PACKING_CASES.items()):
            with ExitStack() as stack:
                if dense:  # keep the model on plain SDPA: the mask transformers builds is dense
                    stack.enter_context(
                        mock.patch(
                            "brace_lightning.models.packing.use_varlen_attention", lambda _m: False
                        )
                    )
                seconds, times = one_run("brace", steps, root, extra, name=f"packing{index}")
            for key in PACKING_SERIES:
                series[case][key] += seconds if key == "step" else times[key]
    medians = {
        case: {key: statistics.median(values) for key, values in columns.items()}
        for case, columns in series.items()
    }
    rows = [
        [
            case,
            f"{median['step']:.3f}",
            f"{median['time/update_ms']:.0f}",
            f"{median['time/old_forward_ms']:.0f}",
            f"{median['step'] / medians['padded']['step']:.2f}",
        ]
        for case, median in medians.items()
    ]
    print_table(
        f"quickstart model (BRACE), {repeats} runs × {steps - 1} timed steps per case, "
        f"threads={torch.get_num_threads()}; medians",
        ["micro-batches", "step s", "PPO update ms", "scoring forwards ms", "step × padded"],
        rows,
    )


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """``title``, a blank line, then a markdown table."""
    print(f"{title}\n")
    print(markdown_table(header, rows))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--packing", action="store_true", help="padded against packed micro-batches instead"
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        default=TARGETS,
        help="configs/targets/*.yaml names; the first is the overhead column's baseline",
    )
    args = parser.parse_args()
    for name in args.targets:
        if not target_config(name).is_file():
            parser.error(f"--targets: {name!r} is not a file {target_config(name)}")
    torch.set_num_threads(args.threads)
    if args.packing:
        with tempfile.TemporaryDirectory() as root:
            packing_table(args.steps, args.repeats, Path(root))
        return
    targets, baseline = args.targets, args.targets[0]
    step_s: dict[str, list[float]] = {t: [] for t in targets}
    target_ms: dict[str, list[float]] = {t: [] for t in targets}
    with tempfile.TemporaryDirectory() as root:
        for _ in range(args.repeats):
            for target in targets:
                seconds, times = one_run(target, args.steps, Path(root))
                step_s[target] += seconds
                target_ms[target] += times["time/value_target_ms"]
    base_step = statistics.median(step_s[baseline])
    base_target = statistics.median(target_ms[baseline]) / 1e3
    rows = []
    for target in targets:
        step = statistics.median(step_s[target])
        vt = statistics.median(target_ms[target]) / 1e3
        overhead = (vt - base_target) / base_step
        rows.append(
            [target, f"{step:.3f}", f"{vt * 1e3:.2f}", f"{vt / step:.3%}", f"{overhead:+.3%}"]
        )
    print_table(
        f"quickstart model, {args.repeats} runs × {args.steps - 1} timed steps per target, "
        f"threads={args.threads}; medians",
        ["value target", "step s", "value target ms", "share of step", f"overhead vs {baseline}"],
        rows,
    )


if __name__ == "__main__":
    main()
