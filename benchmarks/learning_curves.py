"""Learning curves of the quickstart recipe for each value target over several seeds.

    python -m benchmarks.learning_curves [--seeds 0 1 2] [--steps 50] [--jobs 2]

Runs ``brace-lightning fit --config configs/quickstart.yaml --config configs/targets/<t>.yaml`` with
``seed_everything``, the model seed and the data seed set to each seed (one subprocess per run,
``--jobs`` at a time, one torch thread each), reads ``rollout/reward`` back from TensorBoard and
prints the mean ± standard deviation over seeds of the reward averaged over windows of rollout
steps. The first window is the warm-started policy before (and during) critic warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks._common import (
    QUICKSTART,
    REPO,
    cli_command,
    fit_args,
    subprocess_env,
    table_header,
    table_row,
    target_config,
)
from brace_lightning.logs import read_scalars

TARGETS = ["gae", "vtrace", "brace"]


def one_run(target: str, seed: int, steps: int, root: Path, extra: list[str]) -> list[float]:
    """The ``rollout/reward`` series of one run of the quickstart with ``target`` and ``seed``."""
    name = f"{target}_seed{seed}"
    args = fit_args(
        QUICKSTART,
        target_config(target),
        seed=seed,
        data_seed=seed,
        steps=steps,
        log_dir=root,
        run_name=name,
        overrides=extra,
    )
    subprocess.run(
        cli_command(args), check=True, env=subprocess_env(), capture_output=True, cwd=REPO
    )
    (log_dir,) = sorted((root / name).rglob("version_*"))[-1:]  # under the run name
    return [value for _, value in read_scalars(log_dir)["rollout/reward"]]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="more CLI overrides, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            (t, s): pool.submit(one_run, t, s, args.steps, Path(tmp), args.extra)
            for t in TARGETS
            for s in args.seeds
        }
        curves = {key: future.result() for key, future in futures.items()}
    windows = list(range(0, args.steps, args.window))
    print(
        f"quickstart recipe, reward (fraction correct) averaged over rollout steps, mean ± std over "
        f"seeds {args.seeds}\n"
    )
    spans = [f"steps {w + 1}–{min(w + args.window, args.steps)}" for w in windows]
    print(table_header(["target", *spans]))
    for target in TARGETS:
        cells = []
        for w in windows:
            means = [statistics.fmean(curves[target, s][w : w + args.window]) for s in args.seeds]
            spread = statistics.stdev(means) if len(means) > 1 else 0.0
            cells.append(f"{statistics.fmean(means):.3f} ± {spread:.3f}")
        print(table_row([target, *cells]))


if __name__ == "__main__":
    main()
