"""Driver of the multi-process tests in ``tests/test_parallel.py`` (run as a script, never imported
by pytest: Lightning's launcher re-runs this file once per extra rank).

``fixed`` mode trains the tiny actor and critic on one fixed global rollout batch: a run with
``--devices 2`` gives rank r rows ``[r·B/2, (r+1)·B/2)``, a single-process run sees all ``B`` rows,
so with global token normalisation both compute the same update. ``cli`` mode runs
``brace_lightning.cli`` with the remaining arguments. In both modes every rank writes
``rank<r>.json`` into ``--out`` (its metrics, a checksum of the full actor and critic weights, its
prompt stream) and rank 0 writes ``weights.pt`` (the full weights).

python tests/support/parallel_driver.py fixed --out DIR --strategy fsdp --devices 2 --steps 2
python tests/support/parallel_driver.py cli --out DIR -- fit --config configs/quickstart.yaml ...
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, IterableDataset

from brace_lightning.data import PublishTarget
from brace_lightning.models.parallelize import full_state_dict, is_sharded
from brace_lightning.module import BraceModule
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.targets import GRPO

ROWS = 8
WIDTH = 14
PROMPT = 4


def fixed_batch(seed: int = 0) -> RolloutBatch:
    """``ROWS`` rows: a left-padded prompt of 2–4 tokens, then 3–9 actions, reward on the last."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(ROWS, WIDTH, dtype=torch.long)
    attention = torch.zeros(ROWS, WIDTH, dtype=torch.bool)
    mask = torch.zeros(ROWS, WIDTH, dtype=torch.bool)
    rewards = torch.zeros(ROWS, WIDTH)
    for row in range(ROWS):
        prompt = 2 + row % 3
        actions = 3 + (row * 5) % 7
        end = PROMPT + actions
        input_ids[row, PROMPT - prompt : end] = torch.randint(
            3, 100, (prompt + actions,), generator=g
        )
        attention[row, PROMPT - prompt : end] = True
        mask[row, PROMPT:end] = True
        rewards[row, end - 1] = float(row % 2)
    behavior = torch.where(mask, -torch.rand(ROWS, WIDTH, generator=g) * 3 - 1.5, 0.0)
    scores = rewards.sum(1)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        mask=mask,
        behavior_logprobs=behavior,
        versions=torch.where(mask, 0, -1),
        rewards=rewards,
        scores=scores,
        group_ids=torch.arange(ROWS) // 2,
    )


class _Repeat(IterableDataset):
    def __init__(self, batch: RolloutBatch) -> None:
        self.batch = batch

    def __iter__(self) -> Iterator[RolloutBatch]:
        while True:
            yield self.batch


class FixedData(PublishTarget):
    """This rank's rows of :func:`fixed_batch`, every step; records the published versions."""

    def __init__(self) -> None:
        super().__init__()
        self.versions: list[int] = []

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        rows = torch.arange(ROWS).tensor_split(world)[rank]
        return DataLoader(_Repeat(fixed_batch().select(rows)), batch_size=None)

    def publish(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        for bucket in buckets:
            assert all(not hasattr(t, "placements") for t in bucket.values()), "sharded weights"
        self.versions.append(version)


class Recorder(Logger):
    """Keeps every ``log_metrics`` call, on every rank (Lightning's loggers write on rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append({"step": float(step or 0), **metrics})


class RankReport(pl.Callback):
    """At the end of fit every rank writes ``rank<r>.json``; rank 0 also ``weights.pt``. The
    frozen reference policy (``kl_coef`` > 0) is reported as a third model, ``reference_actor``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        weights = {}
        for name in ("actor", "critic", "reference_actor"):
            model = getattr(pl_module, name, None)
            if model is None:
                continue
            state = full_state_dict(model) if is_sharded(model) else model.state_dict()
            weights[name] = {k: v.detach().cpu().clone() for k, v in state.items()}
        recorder = [lg for lg in trainer.loggers if isinstance(lg, Recorder)]
        data = trainer.datamodule
        generator = getattr(data, "_generator", None)
        report = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "sharded": is_sharded(pl_module.actor),
            "packed": pl_module.scorer.packed,  # forwards on packed rows (pack_sequences)
            "policy_version": pl_module.policy_version,
            "rollout_step": pl_module.rollout_step,
            "checksum": {
                name: float(sum(v.double().abs().sum() for v in state.values()))
                for name, state in weights.items()
            },
            "metrics": recorder[0].rows if recorder else [],
            "last_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "published": getattr(data, "versions", []),
            "counters": dict(getattr(data, "counters", {})),
            "prompt_stream": None if generator is None else _peek(generator),
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
        if trainer.global_rank == 0:
            torch.save(weights, self.out / "weights.pt")


def _peek(generator: torch.Generator) -> list[int]:
    """The next draws of ``generator``, without advancing it."""
    clone = torch.Generator().set_state(generator.get_state())
    return torch.randint(0, 2**30, (4,), generator=clone).tolist()


class StopAfter(pl.Callback):
    """Save a checkpoint after rollout step ``batches`` and stop the run there."""

    def __init__(self, batches: int, path: Path) -> None:
        self.batches = batches
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.lightning_module.rollout_step == self.batches:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def run_fixed(args: argparse.Namespace) -> None:
    pl.seed_everything(0, verbose=False)
    strategy: Any
    if args.strategy == "fsdp":
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    elif args.strategy == "ddp":
        strategy = "ddp_find_unused_parameters_true"
    else:
        strategy = "auto"
    # --target GRPO: critic-free (groups of 2 rows, each on one rank); no meta init without a critic.
    # GRPO_OPOB: with VCPO's optimal baseline (one autograd.grad per row before the update);
    # GRPO_OPOB_LOGITS: with its forward-only norms (one no-grad forward per micro-batch).
    critic_free = {
        "GRPO": {"value_target": GRPO()},
        "GRPO_OPOB": {"value_target": GRPO(optimal_baseline=True)},
        "GRPO_OPOB_LOGITS": {"value_target": GRPO(optimal_baseline=True, score_norm="logits")},
    }.get(args.target, {})
    module = BraceModule(
        **critic_free,
        loss_aggregation=args.aggregation,
        tiny_hidden_size=64,
        tiny_num_layers=2,
        critic_warmup_steps=0,
        micro_batch_size=2,
        max_tokens_per_micro_batch=args.max_tokens,
        pack_sequences=args.pack,
        # SGD with momentum: unlike Adam the update scales with the gradient, so a wrong factor in
        # the loss normalisation shows, and the momentum buffers test the optimizer checkpoint.
        actor_optimizer=functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9),
        critic_optimizer=functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9),
        activation_checkpointing=args.activation_checkpointing,
        # FSDP runs build on the meta device and fill each rank's shards; the tests compare them
        # with single processes built the usual way.
        fsdp_meta_init=args.strategy == "fsdp" and not critic_free,
    )
    callbacks: list[pl.Callback] = [RankReport(args.out)]
    if args.stop_after:
        callbacks.append(StopAfter(args.stop_after, args.out / "ckpt"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=args.steps,
        logger=Recorder(),
        log_every_n_steps=1,  # the module logs through self.log_dict, once per rollout step
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    # Lightning 2.6.6 loads a sharded checkpoint's metadata with torch.load(weights_only=True)
    # whatever fit() is told, and the hyperparameters hold the optimizer partials.
    torch.serialization.add_safe_globals([functools.partial, torch.optim.SGD])
    trainer.fit(module, datamodule=FixedData(), ckpt_path=args.resume)


def run_cli(args: argparse.Namespace, rest: list[str]) -> None:
    from brace_lightning.cli import run

    run(rest, trainer_defaults={"callbacks": [RankReport(args.out)]})


def main() -> None:
    torch.set_num_threads(1)
    argv = sys.argv[1:]
    rest: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["fixed", "cli"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=["single", "ddp", "fsdp"], default="single")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--pack", action="store_true", help="BraceModule(pack_sequences=True)")
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument(
        "--target", choices=["BRACE", "GRPO", "GRPO_OPOB", "GRPO_OPOB_LOGITS"], default="BRACE"
    )
    parser.add_argument("--aggregation", default="token_mean", help="BraceModule(loss_aggregation)")
    parser.add_argument("--resume", type=str, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.mode == "fixed":
        run_fixed(args)
    else:
        run_cli(args, rest)


if __name__ == "__main__":
    main()
