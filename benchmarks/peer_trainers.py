"""The quickstart's model and task trained by TRL's ``GRPOTrainer`` and by ours, side by side.

    python -m benchmarks.peer_trainers [--steps 30] [--seeds 3] [--prompts 16] [--samples 8]
                                       [--tokens 40] [--only trl sync async1 async2] [--out DIR]

Both trainers start from the same weights: the quickstart's supervised warm start
(``SupervisedWarmStart``) runs once, its actor is saved as a Hugging Face folder
(:func:`benchmarks._common.warm_start_once`) and both load it. Both then train it on the quickstart
task (single-digit addition, ``ArithmeticReward`` wrapped as a TRL reward function) with the same
prompts per step (the same prompt stream: TRL's dataset is the sequence our data module draws for
the seed, unshuffled), ``--samples`` samples per prompt (TRL's ``num_generations``), at most
``--tokens`` new tokens at temperature 1, the quickstart's optimizer (AdamW, lr 1e-4, betas (0.9,
0.999), weight decay 0.01, constant rate, gradient norm clipped at 1), one optimizer step per rollout
batch (TRL's defaults: ``num_iterations=1``, one generation per step), the clip range 0.2 / 0.28, no
KL term, the GRPO advantage (r - mean) / (std + eps) per prompt group and the token-mean loss (TRL's
default ``loss_type="dapo"``; ours ``loss_aggregation=token_mean``, advantages not whitened again).

Arms: ``trl`` (``GRPOTrainer``, synchronous: it generates with ``model.generate``; its vLLM paths
need a vLLM server or a CUDA vLLM, see docs/benchmarks.md), ``sync`` (ours, ``RolloutDataModule``
with lag 0), ``async1`` and ``async2`` (ours, ``AsyncRolloutDataModule`` with ``max_staleness`` 1
and 2: a producer process generates the next batches while the trainer trains). Every run is its
own spawned process with one torch thread (the async producer has one more), and the arms take
turns within each seed, so that load from other processes falls on every arm alike.

Per step: wall time (from the end of the previous step; step 1, which holds start-up, is left out
of every time), completion tokens, the mean reward of the rollout batch, and where the time goes:
*generate* = generation and reward (TRL: ``_generate`` plus ``_calculate_rewards``; ours: the
engine's ``data/generate_s``, which also scores), *score* = the no-gradient forwards before the
update (TRL: the rest of ``_generate_and_score_completions``; ours: ``time/old_forward_ms``),
*update* = the optimizer step (TRL: the step's wall time minus generation and scoring; ours:
``time/update_ms``, value target and weight sync). Rates: *generated tokens/s* = completion tokens
/ generate; *trainer tokens/s* = completion tokens / (score + update) (async: the step's wall time
minus the trainer's wait for a batch); *end-to-end tokens/s* = completion tokens / wall time.
Tables show the median over seeds of each run's median over steps; *x TRL* is the median of the
per-seed ratios of end-to-end tokens/s (the arms of a seed ran back to back). Peak memory is the
trainer process's resident high-water mark (``VmHWM``), imports included. The final reward is the
mean reward of the last ``--final`` steps, its median and range over seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import multiprocessing
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import (
    CONFIGS,
    QUICKSTART,
    fit_args,
    markdown_table,
    positive_int,
    proc_kib,
    warm_start_once,
)

#: Arm name -> its row label.
ARMS: dict[str, str] = {
    "trl": "TRL GRPOTrainer (sync)",
    "sync": "ours, GRPO (sync)",
    "async1": "ours, GRPO (async S=1)",
    "async2": "ours, GRPO (async S=2)",
}

#: The quickstart recipe's settings both trainers are given (configs/quickstart.yaml).
LEARNING_RATE = 1e-4
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
#: torch.optim.AdamW's defaults, the quickstart's optimizer (TRL's own default decay is 0).
WEIGHT_DECAY = 0.01
#: Our GRPO arm: the quickstart recipe with the critic-free GRPO target, one optimizer step per
#: rollout batch, TRL's token-mean loss and no second whitening of the group advantages.
OURS_GRPO: list[str] = [
    "--model.value_target=brace_lightning.targets.GRPO",  # eps 1e-4 by default, as TRL's
    "--model.loss_aggregation=token_mean",
    "--model.whiten_advantages=false",
    "--model.ppo_epochs=1",
    "--model.num_minibatches=1",
    "--model.critic_warmup_steps=0",
]


@dataclass(frozen=True)
class RunSpec:
    """One training run: the arm, the seed and the shared workload."""

    arm: str
    seed: int
    steps: int
    prompts: int
    samples: int
    tokens: int
    actor: str
    folder: str


# ------------------------------------------------------------------------------ the prompts


def quickstart_task() -> Any:
    """The quickstart's task: single-digit addition (configs/quickstart.yaml)."""
    from brace_lightning.tasks import ArithmeticTask

    return ArithmeticTask(num_operands=2, max_value=9, ops="+")


def prompt_stream(seed: int, count: int) -> list[Any]:
    """The first ``count`` prompts our data module draws for ``seed`` (its generator is seeded
    with the run's seed and draws ``prompts_per_step`` prompts per step), in order."""
    return quickstart_task().sample(count, torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ TRL


def trl_run(spec: RunSpec) -> dict[str, Any]:
    """Train with TRL's ``GRPOTrainer``; per-step times, tokens and rewards."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from brace_lightning.tasks import ArithmeticReward

    prompts = prompt_stream(spec.seed, spec.steps * spec.prompts)
    reward = ArithmeticReward()

    def arithmetic_reward(completions: list[str], index: list[int], **_: Any) -> list[float]:
        """The quickstart reward as a TRL reward function (``index``: the dataset's column)."""
        return [reward(prompts[i], text) for i, text in zip(index, completions, strict=True)]

    dataset = Dataset.from_dict(
        {"prompt": [p.text for p in prompts], "index": list(range(len(prompts)))}
    )
    config = GRPOConfig(
        output_dir=str(Path(spec.folder) / "trl"),
        use_cpu=True,
        bf16=False,
        seed=spec.seed,
        max_steps=spec.steps,
        per_device_train_batch_size=spec.prompts * spec.samples,
        num_generations=spec.samples,
        max_completion_length=spec.tokens,
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(spec.actor),
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(spec.actor),
    )
    seconds: dict[str, list[float]] = {"generate": [], "reward": [], "generate_and_score": []}
    tokens: list[float] = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds[name].append(time.perf_counter() - start)
            if name == "generate_and_score":
                tokens.append(float(out["completion_mask"].sum()))
            return out

        return wrapper

    trainer._generate = timed("generate", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed(
        "generate_and_score", trainer._generate_and_score_completions
    )
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    trainer.add_callback(Clock())
    trainer.train()
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    wall = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    generate = [g + r for g, r in zip(seconds["generate"], seconds["reward"], strict=True)]
    score = [t - g for t, g in zip(seconds["generate_and_score"], generate, strict=True)]
    update = [w - t for w, t in zip(wall, seconds["generate_and_score"], strict=True)]
    return dict(
        wall=wall, generate=generate, score=score, update=update, tokens=tokens, reward=rewards
    )


# ------------------------------------------------------------------------------------ ours


def ours_run(spec: RunSpec) -> dict[str, Any]:
    """Train with our GRPO target (synchronous or asynchronous); per-step times, tokens and
    rewards, read from the run's TensorBoard scalars."""
    import lightning.pytorch as pl

    from brace_lightning.cli import run
    from brace_lightning.logs import read_scalars

    ends: list[float] = []

    class Clock(pl.Callback):
        def on_train_start(self, *args: Any) -> None:
            ends.append(time.perf_counter())

        def on_train_batch_end(self, *args: Any) -> None:
            ends.append(time.perf_counter())

    configs = [QUICKSTART]
    data = [
        f"--model.actor={spec.actor}",
        f"--data.init_args.prompts_per_step={spec.prompts}",
        f"--data.init_args.samples_per_prompt={spec.samples}",
        f"--data.init_args.engine.init_args.max_new_tokens={spec.tokens}",
    ]
    if spec.arm.startswith("async"):
        configs.append(CONFIGS / "async.yaml")
        data.append(f"--data.init_args.max_staleness={spec.arm.removeprefix('async')}")
    args = fit_args(
        *configs,
        seed=spec.seed,
        steps=spec.steps,
        callbacks=False,
        log_dir=Path(spec.folder) / "runs",
        run_name=f"{spec.arm}_{spec.seed}",
        overrides=[*OURS_GRPO, *data],
    )
    cli = run(args, trainer_defaults={"callbacks": [Clock()]})
    scalars = read_scalars(cli.trainer.logger.log_dir)

    def series(name: str) -> list[float]:
        return [value for _, value in sorted(scalars.get(name, []))]

    ms = [series(f"time/{name}_ms") for name in ("update", "value_target", "weight_sync")]
    update = [sum(parts) / 1e3 for parts in zip(*ms, strict=True)]
    lengths = series("rollout/response_length")
    count = spec.prompts * spec.samples
    out = dict(
        wall=[b - a for a, b in zip(ends, ends[1:], strict=False)],
        generate=series("data/generate_s"),
        score=[value / 1e3 for value in series("time/old_forward_ms")],
        update=update,
        tokens=[length * count for length in lengths],
        reward=series("rollout/reward"),
    )
    if spec.arm.startswith("async"):
        out["trainer_idle"] = series("data/trainer_idle_s")
    return out


# ------------------------------------------------------------------------------- the runs


def _child(spec: RunSpec, queue: Any) -> None:
    """A run in its own process: one torch thread, quiet, its peak memory measured at the end."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    with contextlib.redirect_stdout(io.StringIO()):  # TRL prints every step's logs
        result = trl_run(spec) if spec.arm == "trl" else ours_run(spec)
    result["peak_rss_mib"] = proc_kib("VmHWM") / 1024
    queue.put(result)


def run_in_process(spec: RunSpec) -> dict[str, Any]:
    """:func:`_child` in a spawned process (a fresh interpreter, so that neither trainer's
    imports, threads or memory reach the other's measurement)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(spec, queue))
    process.start()
    result = queue.get()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"the {spec.arm} run of seed {spec.seed} exited with {process.exitcode}")
    return result


def warm_start(folder: Path, steps: int | None = None) -> Path:
    """The quickstart's supervised warm start (``steps`` of it; None: the recipe's), run once; the
    folder of the warm-started actor.

    A one-step ``fit`` whose single step is a critic warm-up step exports the actor exactly as the
    warm start left it (as benchmarks/lm_staleness.py does)."""
    overrides = [
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=1",
        "--model.critic_warmup_steps=1",
        "--trainer.logger=false",
    ]
    if steps is not None:  # and one pass over as many pairs as it trains on (batches of 64)
        overrides.append(f"--trainer.callbacks.init_args.steps={steps}")
        overrides.append(f"--trainer.callbacks.init_args.num_pairs={64 * steps}")
    warm_start_once(folder, fit_args(QUICKSTART, seed=0, overrides=overrides))
    return folder / "actor"


# ---------------------------------------------------------------------------- the tables


def steady(values: Sequence[float]) -> float:
    """Median over the steps after step 1 (step 1 holds start-up and the first generation)."""
    return statistics.median(values[1:])


def summarise(result: dict[str, Any]) -> dict[str, float]:
    """One run's medians over steps: seconds per phase, tokens per step and the rates."""
    wall, tokens = steady(result["wall"]), steady(result["tokens"])
    generate, score, update = (steady(result[k]) for k in ("generate", "score", "update"))
    # What the trainer waits for each step: the generation (sync) or the producer's next batch.
    waits = result.get("trainer_idle", result["generate"])
    phases = zip(result["wall"], waits, result["score"], result["update"], strict=True)
    other = steady([w - wait - s - u for w, wait, s, u in phases])
    trainer = wall - steady(result["trainer_idle"]) if "trainer_idle" in result else score + update
    return {
        "wall": wall,
        "tokens": tokens,
        "generate": generate,
        "score": score,
        "update": update,
        "other": other,
        "generated_tps": tokens / generate,
        "trainer_tps": tokens / trainer,
        "tps": tokens / wall,
        "peak": result["peak_rss_mib"],
    }


def tables(results: dict[str, list[dict[str, Any]]], final: int) -> str:
    """The comparison, the time breakdown and the reward curves as Markdown tables."""
    arms = list(results)
    summary = {arm: [summarise(r) for r in runs] for arm, runs in results.items()}

    def median(arm: str, key: str) -> float:
        return statistics.median(s[key] for s in summary[arm])

    def ratio(arm: str) -> str:
        if "trl" not in summary:
            return "-"
        ratios = [s["tps"] / t["tps"] for s, t in zip(summary[arm], summary["trl"], strict=True)]
        return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"

    def final_reward(arm: str) -> str:
        finals = [statistics.fmean(r["reward"][-final:]) for r in results[arm]]
        return f"{statistics.median(finals):.3f} ({min(finals):.3f}-{max(finals):.3f})"

    header = ["trainer", "s/step", "completion tokens/step", "generated tokens/s"]
    header += ["trainer tokens/s", "end-to-end tokens/s", "x TRL (range)", "peak RSS MiB"]
    header += [f"final reward (last {final} steps; range)"]
    rows = [
        [
            ARMS[arm],
            f"{median(arm, 'wall'):.3f}",
            f"{median(arm, 'tokens'):.0f}",
            f"{median(arm, 'generated_tps'):.0f}",
            f"{median(arm, 'trainer_tps'):.0f}",
            f"{median(arm, 'tps'):.0f}",
            ratio(arm),
            f"{median(arm, 'peak'):.0f}",
            final_reward(arm),
        ]
        for arm in arms
    ]
    breakdown_header = [
        "trainer",
        "step s",
        "generate + reward s",
        "score s",
        "update s",
        "other s",
    ]
    breakdown = [
        [
            ARMS[arm],
            *(f"{median(arm, k):.3f}" for k in ("wall", "generate", "score", "update", "other")),
        ]
        for arm in arms
    ]
    steps = len(next(iter(results.values()))[0]["reward"])
    curve = [
        [
            step + 1,
            *(f"{statistics.median(r['reward'][step] for r in results[arm]):.3f}" for arm in arms),
        ]
        for step in range(steps)
    ]
    return "\n\n".join(
        [
            markdown_table(header, rows),
            "Where a step's time goes (medians; other = the step minus what is timed: for TRL "
            "none, its update is the rest of the step; async rows: generation runs in the "
            "producer, other = the step minus the trainer's wait for a batch, score and update)",
            markdown_table(breakdown_header, breakdown),
            "Mean reward of each step's rollout batch (median over seeds)",
            markdown_table(["step", *(ARMS[arm] for arm in arms)], curve),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=30, help="rollout steps per run")
    parser.add_argument("--seeds", type=positive_int, default=3, help="seeds 0, 1, ...")
    parser.add_argument("--prompts", type=positive_int, default=16, help="prompts per step")
    parser.add_argument("--samples", type=positive_int, default=8, help="samples per prompt")
    parser.add_argument("--tokens", type=positive_int, default=40, help="max new tokens")
    parser.add_argument("--final", type=positive_int, default=5, help="steps of the final reward")
    parser.add_argument(
        "--warm-start-steps", type=positive_int, default=None, help="default: the quickstart's"
    )
    parser.add_argument("--only", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument(
        "--out", type=Path, default=None, help="warm start and runs (default: temp)"
    )
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(
            f"argument --steps: expected at least 2 (step 1 is left out of the times); got {args.steps}"
        )
    if args.samples < 2:
        parser.error(f"argument --samples: expected at least 2 (a GRPO group); got {args.samples}")
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory() as temporary:
        out = args.out or Path(temporary)
        actor = warm_start(out / "warm_start", args.warm_start_steps)
        results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.only}
        for seed in range(args.seeds):
            for arm in args.only:
                spec = RunSpec(
                    arm,
                    seed,
                    args.steps,
                    args.prompts,
                    args.samples,
                    args.tokens,
                    str(actor),
                    str(out),
                )
                results[arm].append(run_in_process(spec))
    print(
        f"\n{args.steps} rollout steps x {args.prompts} prompts x {args.samples} samples (at most "
        f"{args.tokens} new tokens), the quickstart's warm-started tiny-char model, {args.seeds} "
        f"seed(s), one torch thread per process\n"
    )
    print(tables(results, min(args.final, args.steps)))


if __name__ == "__main__":
    main()
