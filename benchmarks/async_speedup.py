"""Wall time of one training run with synchronous versus asynchronous rollouts (and BRACE vs GAE).

    python -m benchmarks.async_speedup [--steps 16] [--repeats 3] [--prompts 16] [--samples 2]
                                       [--tokens 200] [--hidden 32] [--layers 1] [--only ROW ...]

Every row trains the same workload: ``--steps`` rollout steps of ``--prompts`` prompts x
``--samples`` samples, responses of exactly ``--tokens`` tokens (no stop token, so generation cost
does not drift as the policy learns), one PPO epoch in two minibatches, the tiny Qwen2
(``--hidden``, ``--layers``), no warm start. The defaults make generation and training of a step
take about the same time on one core each (the *generate s* and *train s* columns show the balance).
A small model's decoding loop is bound by per-step overhead, so its time hardly depends on the batch
while training's grows with it: at ``--samples 4`` training is the longer phase and bounds the
speed-up.

- ``sync``: :class:`RolloutDataModule` (lag 0), generation and training one after the other in the
  training process, with 1 and with 2 torch threads (two threads give both phases both cores).
- ``async S``: :class:`AsyncRolloutDataModule` with a producer process (1 torch thread) next to a
  trainer with 1 thread. S = 0 cannot overlap (the producer waits for each step's weights); S >= 1
  generates the next batch while the trainer trains.

Timing: *steady* = wall time from the end of rollout step 1 to the end of the last step, divided by
``steps - 1`` (step 1 holds the producer's start-up and the first generation, which no overlap can
hide); *fit* = the whole ``Trainer.fit``; *generate s* = the engine's time per rollout batch (in the
producer for async rows); *train s* = steady minus the trainer's wait for a batch (for sync rows, minus
the generation). The configurations are interleaved within each repeat so that background load hits
them alike; a speed-up is the median (and range) of the per-repeat ratios of the baseline's steady
time to the row's, against sync with 1 thread and with 2 threads. The second table compares the BRACE
and GAE value targets: the step times (whose difference is machine noise) and the value-target kernel
time (``time/value_target_ms``), whose difference is BRACE's overhead.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

from benchmarks._common import positive_int, table_header, table_row
from brace_lightning.data import AsyncRolloutDataModule, RolloutDataModule
from brace_lightning.module import BraceModule
from brace_lightning.rollout import EmbeddedEngine
from brace_lightning.targets import BRACE, GAE
from brace_lightning.tasks import ArithmeticReward, ArithmeticTask


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call (one per rollout step with ``log_every_n_steps=1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class StepClock(pl.Callback):
    """Wall clock at the end of every rollout step."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def run_once(config: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """Train one configuration; steady step time, fit time and a few logged means."""
    torch.set_num_threads(config.get("threads", 1))
    engine = partial(EmbeddedEngine, max_new_tokens=args.tokens, stop_token_ids=[])
    common = dict(
        task=ArithmeticTask(),
        reward=ArithmeticReward(),
        engine=engine,
        prompts_per_step=args.prompts,
        samples_per_prompt=args.samples,
    )
    if config["kind"] == "sync":
        datamodule = RolloutDataModule(**common, lag=0)
    else:
        datamodule = AsyncRolloutDataModule(
            **common, max_staleness=config["S"], lag=config.get("lag")
        )
    module = BraceModule(
        tiny_hidden_size=args.hidden,
        tiny_num_layers=args.layers,
        value_target=config.get("target", BRACE)(),
        ppo_epochs=1,
        num_minibatches=2,
        critic_warmup_steps=0,
    )
    clock, logger = StepClock(), MemoryLogger()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=args.steps,
        logger=logger,
        log_every_n_steps=1,  # the module logs through self.log_dict, once per rollout step
        callbacks=[clock],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule)
    fit = time.perf_counter() - start
    torch.set_num_threads(1)
    rows = logger.rows[1:]  # after step 1, like the steady time

    def mean(name: str) -> float:
        values = [row[name] for row in rows if name in row]
        return statistics.fmean(values) if values else float("nan")

    return {
        "steady": (clock.ends[-1] - clock.ends[0]) / (len(clock.ends) - 1),
        "fit": fit,
        "generate": mean("data/generate_s"),
        "trainer_wait": mean("data/trainer_idle_s")
        if config["kind"] == "async"
        else mean("data/generate_s"),
        "staleness": mean("data/staleness_mean"),
        "trainer_idle": mean("data/trainer_idle_fraction"),
        "producer_idle": mean("data/producer_idle_fraction"),
        "value_target_ms": statistics.median(
            row["time/value_target_ms"] for row in rows if "time/value_target_ms" in row
        ),
    }


CONFIGS: dict[str, dict[str, Any]] = {
    "sync, 1 thread": {"kind": "sync", "threads": 1},
    "sync, 2 threads": {"kind": "sync", "threads": 2},
    "async S=0": {"kind": "async", "S": 0},
    "async S=1": {"kind": "async", "S": 1},
    "async S=2": {"kind": "async", "S": 2},
    "async S=4": {"kind": "async", "S": 4},
    "fixed lag S=2": {"kind": "async", "S": 2, "lag": 2},
    "async S=2, GAE": {"kind": "async", "S": 2, "target": GAE},
    "sync, 1 thread, GAE": {"kind": "sync", "threads": 1, "target": GAE},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--prompts", type=positive_int, default=16)
    parser.add_argument("--samples", type=positive_int, default=2)
    parser.add_argument("--tokens", type=positive_int, default=200)
    parser.add_argument("--hidden", type=positive_int, default=32)
    parser.add_argument("--layers", type=positive_int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="run only these rows")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(
            f"argument --steps: expected at least 2 (steady time starts after step 1); got {args.steps}"
        )
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    names = [n for n in CONFIGS if args.only is None or n in args.only]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            results[name].append(run_once(CONFIGS[name], args))

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    def speedup(name: str, baseline: str) -> str:
        """Median and range of the per-repeat ratios baseline / row (the two ran back to back)."""
        if baseline not in results:
            return "-"
        ratios = [
            b["steady"] / r["steady"] for b, r in zip(results[baseline], results[name], strict=True)
        ]
        return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"

    samples = args.prompts * args.samples
    print(
        f"\n{args.steps} rollout steps x {samples} samples x {args.tokens} tokens, tiny Qwen2 "
        f"(hidden {args.hidden}, {args.layers} layer(s)), medians of {args.repeats} runs "
        "(speed-ups: median and range of the per-repeat ratios)\n"
    )
    header = ["configuration", "steady s/step", "samples/s", "speed-up vs sync 1 thread"]
    header += ["vs sync 2 threads", "fit s", "generate s", "train s", "staleness"]
    print(table_header([*header, "trainer idle", "producer idle"]))
    for name in names:
        if "GAE" in name:
            continue
        steady = median(name, "steady")
        cells = [name, f"{steady:.3f}", f"{samples / steady:.0f}"]
        cells += [speedup(name, "sync, 1 thread"), speedup(name, "sync, 2 threads")]
        cells += [f"{median(name, 'fit'):.1f}", f"{median(name, 'generate'):.3f}"]
        cells += [
            f"{steady - median(name, 'trainer_wait'):.3f}",
            f"{median(name, 'staleness'):.2f}",
        ]
        cells += [f"{median(name, 'trainer_idle'):.2f}", f"{median(name, 'producer_idle'):.2f}"]
        print(table_row(cells))
    pairs = [("async S=2", "async S=2, GAE"), ("sync, 1 thread", "sync, 1 thread, GAE")]
    pairs = [(b, g) for b, g in pairs if b in results and g in results]
    if pairs:
        header = ["rollouts", "BRACE s/step", "GAE s/step", "step difference", "BRACE target ms"]
        print("\n" + table_header([*header, "GAE target ms", "target overhead (% of step)"]))
        for brace_name, gae_name in pairs:
            b, g = median(brace_name, "steady"), median(gae_name, "steady")
            b_ms, g_ms = median(brace_name, "value_target_ms"), median(gae_name, "value_target_ms")
            cells = [brace_name, f"{b:.3f}", f"{g:.3f}", f"{100 * (b / g - 1):+.1f}%"]
            cells += [f"{b_ms:.2f}", f"{g_ms:.2f}", f"{100 * (b_ms - g_ms) / (1e3 * b):.2f}%"]
            print(table_row(cells))


if __name__ == "__main__":
    main()
