"""The synchronous rollout data module: one fresh rollout batch per training step.

Each training step pulls one :class:`~brace_lightning.rollout.types.RolloutBatch` (the module's
``training_step`` takes the iterator, so Lightning prefetches nothing and a batch is generated only
after the previous step's weights were published). With ``lag = 0`` the engine samples with the
trainer's current weights (synchronous on-policy PPO, staleness 0). With ``lag = S`` the engine
always holds the weights of exactly S versions ago (``lag_mode: fixed`` of the async design),
independent of timing, so staleness sweeps are reproducible on any machine.

Staleness is re-checked when a batch is handed to the trainer: a row whose oldest token is more
than ``max_staleness`` versions old is dropped and counted (``dropped_stale``). Counts are conserved:
generated = trained + dropped (by reason); this module buffers nothing between steps.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import PreTrainedTokenizerBase

from brace_lightning.checks import require_int
from brace_lightning.data.empty import EmptyBatchGuard
from brace_lightning.data.throughput import TokenThroughput
from brace_lightning.models import load_tokenizer
from brace_lightning.models.parallelize import unsharded_copy
from brace_lightning.models.weight_sync import collect_buckets, module_bucket_bytes
from brace_lightning.rollout.embedded import EmbeddedEngine
from brace_lightning.rollout.engine import RolloutEngine
from brace_lightning.rollout.multiturn import check_reward_or_env, collect_batch
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.seeds import run_seed
from brace_lightning.tasks.base import PromptSource, RewardFunction
from brace_lightning.tasks.env import ToolEnvironment

EngineFactory = Callable[[nn.Module], RolloutEngine]

#: Sample counters (generated = trained + dropped_*), then ``empty_batches``, the rollout batches
#: skipped because nothing in them was left to train on (``data/empty.py``).
COUNTERS = (
    "generated",
    "trained",
    "dropped_stale",
    "dropped_reward_error",
    "dropped_empty",
    "empty_batches",
)


class _RolloutStream(IterableDataset):
    """Endless stream of rollout batches produced by ``datamodule.next_batch()``."""

    def __init__(self, datamodule: RolloutDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[RolloutBatch]:
        while True:
            yield self.datamodule.next_batch()


class _ValidationRollouts(IterableDataset):
    """``num_batches`` rollout batches sampled with the trainer's *current* actor weights.

    Every validation pass draws the same prompts (a generator seeded with ``seed``) and builds a
    fresh engine from the actor, so the rows are on-policy: their realized returns are unbiased
    Monte-Carlo estimates of V^π, the reference of the critic's ``val/value_gap_mc``.
    """

    def __init__(self, datamodule: pl.LightningDataModule, num_batches: int, seed: int) -> None:
        self.datamodule = datamodule
        self.num_batches = num_batches
        self.seed = seed

    def __iter__(self) -> Iterator[RolloutBatch]:
        dm: Any = self.datamodule
        module = dm.trainer.lightning_module
        actor = unsharded_copy(module.actor, bucket_bytes=module_bucket_bytes(module))
        engine = (dm.engine_factory or EmbeddedEngine)(actor)
        generator = torch.Generator().manual_seed(self.seed)
        try:
            for index in range(self.num_batches):
                prompts = dm.task.sample(dm.prompts_per_step, generator)
                yield collect_batch(
                    engine,
                    prompts,
                    dm.tokenizer,
                    reward=dm.reward,
                    env=dm.env,
                    num_samples=dm.samples_per_prompt,
                    group_id_offset=index * len(prompts),
                )
        finally:
            engine.close()


def skip_validation_without_batches(datamodule: Any, stage: str) -> None:
    """With ``val_batches=0`` a ``fit`` has no validation: tell the trainer so
    (``limit_val_batches = 0``, called from the data module's ``setup``) instead of handing it an
    empty loader, for which Lightning warns that the loader has zero length on every rank."""
    trainer = datamodule.trainer
    if stage == "fit" and datamodule.val_batches == 0 and trainer is not None:
        trainer.limit_val_batches = 0


def validation_loader(datamodule: pl.LightningDataModule, num_batches: int, seed: int) -> Any:
    """The ``val_dataloader`` of both rollout data modules: ``num_batches`` on-policy batches
    (an empty list when 0, which Lightning treats as "no validation")."""
    if num_batches == 0:
        return []
    return DataLoader(
        _ValidationRollouts(datamodule, num_batches, seed), batch_size=None, num_workers=0
    )


class RolloutDataModule(pl.LightningDataModule):
    """Generates rollout batches with an engine that holds the actor's (possibly lagged) weights.

    Args:
        task: where prompts come from (e.g. ``brace_lightning.tasks.ArithmeticTask``).
        reward: the verifier of single-turn responses (e.g.
            ``brace_lightning.tasks.ArithmeticReward``); must be None when ``env`` is set.
        env: a multi-turn tool environment (e.g. ``brace_lightning.tasks.CalculatorEnv``): batches
            are then episodes of ``rollout.multiturn.collect_episodes`` (tool observations are not
            actions), scored by the environment's verifier; None = single-turn rollouts.
        tokenizer: tokenizer source: ``"tiny-char"`` (built-in character tokenizer), a local path
            or a hub name. Linked to ``model.actor`` by the CLI.
        engine: builds the rollout engine from the actor (``class_path`` of an engine whose first
            argument is the model, e.g. ``brace_lightning.rollout.EmbeddedEngine``); None uses the
            embedded engine with its defaults.
        prompts_per_step: prompts per rollout batch.
        samples_per_prompt: responses per prompt (a group).
        lag: the engine samples with the weights of exactly ``lag`` versions ago (0 = on-policy).
        max_staleness: rows older than this many versions when consumed are dropped; None = no
            bound. Must be >= ``lag`` (else every batch would be dropped).
        seed: seed of the prompt draws (None: the run's ``seed_everything``, see
            ``brace_lightning.seeds``).
        val_batches: rollout batches per validation pass (``validate``, and during ``fit`` every
            ``trainer.check_val_every_n_epoch``), sampled with the current weights from the same
            fixed prompts each time; 0 = no validation.
        max_consecutive_empty_batches: a batch with no sample left to train on (all dropped) is
            skipped and counted in ``count/empty_batches``; this many in a row stop the run.
    """

    def __init__(
        self,
        *,
        task: PromptSource,
        reward: RewardFunction | None = None,
        env: ToolEnvironment | None = None,
        tokenizer: str = "tiny-char",
        engine: EngineFactory | None = None,
        prompts_per_step: int = 16,
        samples_per_prompt: int = 4,
        lag: int = 0,
        max_staleness: int | None = None,
        seed: int | None = None,
        val_batches: int = 0,
        max_consecutive_empty_batches: int = 10,
    ) -> None:
        super().__init__()
        self._empty = EmptyBatchGuard(max_consecutive_empty_batches)
        self._throughput = TokenThroughput()
        for name, value, low in (
            ("prompts_per_step", prompts_per_step, 1),
            ("samples_per_prompt", samples_per_prompt, 1),
            ("lag", lag, 0),
            ("val_batches", val_batches, 0),
        ):
            require_int(name, value, low)
        if max_staleness is not None and (
            not isinstance(max_staleness, int) or max_staleness < lag
        ):
            raise ValueError(
                f"max_staleness must be None or an integer >= lag={lag}; got {max_staleness!r}."
            )
        check_reward_or_env(reward, env)
        self.task = task
        self.reward = reward
        self.env = env
        self.tokenizer_source = tokenizer
        self.engine_factory = engine
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.lag = lag
        self.max_staleness = max_staleness
        self.seed = seed = run_seed(seed)
        self.val_batches = val_batches
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(tokenizer)
        self.engine: RolloutEngine | None = None
        self.trainer_version = 0
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._generator = torch.Generator().manual_seed(seed)
        self._next_group = 0
        # version -> CPU weights, kept while a lagged engine may still need them
        self._history: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._engine_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ Lightning hooks

    def train_dataloader(self) -> DataLoader:
        # batch_size=None: the stream already yields whole batches; no worker processes, because
        # the engine must see the weights published by the training process after every step.
        return DataLoader(_RolloutStream(self), batch_size=None, num_workers=0)

    def val_dataloader(self) -> Any:
        return validation_loader(self, self.val_batches, self.seed + 1)

    def setup(self, stage: str) -> None:
        seed_for_rank(self)
        skip_validation_without_batches(self, stage)

    def teardown(self, stage: str) -> None:
        if self.engine is not None:
            self.engine.close()

    def state_dict(self) -> dict[str, Any]:
        return gather_rank_states(self, self._local_state_dict())

    def _local_state_dict(self) -> dict[str, Any]:
        return {
            "generator": self._generator.get_state(),
            "trainer_version": self.trainer_version,
            "counters": dict(self.counters),
            "next_group": self._next_group,
            "history": dict(self._history),
            "engine": None if self.engine is None else self.engine.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = rank_state(self, state_dict)
        self._generator.set_state(state_dict["generator"])
        self.trainer_version = int(state_dict["trainer_version"])
        self.counters = {**dict.fromkeys(COUNTERS, 0), **state_dict["counters"]}
        self._next_group = int(state_dict["next_group"])
        self._history = OrderedDict(sorted(state_dict["history"].items()))
        self._engine_state = state_dict["engine"]
        self.engine = None  # rebuilt from the restored actor on the next batch

    # ------------------------------------------------------------------ weights and versions

    def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """The trainer finished version ``version``; hand the engine the weights it should use."""
        self._install(weights, version, fresh=False)

    def _install(self, weights: Mapping[str, torch.Tensor], version: int, *, fresh: bool) -> None:
        """:meth:`publish`; ``fresh`` weights are new CPU tensors this module may keep as they are
        (a lagged engine's history needs no second copy of them)."""
        if version <= self.trainer_version and self.engine is not None:
            raise ValueError(
                f"publish got version={version}; expected a version above the last one "
                f"({self.trainer_version})."
            )
        self.trainer_version = version
        if self.lag == 0:
            if self.engine is not None:
                self.engine.update_weights(weights, version)
            return
        self._history[version] = _cpu_copy(weights, fresh)
        behavior_version = version - self.lag
        for old in [v for v in self._history if v < behavior_version]:
            del self._history[old]
        if self.engine is not None and behavior_version in self._history:
            self.engine.update_weights(self._history[behavior_version], behavior_version)

    def publish_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        """:meth:`publish` for weights arriving as buckets of the full state dict (an FSDP2
        trainer gathers them a bucket at a time, ``models/weight_sync.py``): at ``lag`` 0 each
        bucket goes straight into the engine (``update_weights_from_buckets``), with a lag they
        are kept as this version's CPU copy. The caller runs the stream to its end afterwards."""
        if version <= self.trainer_version and self.engine is not None:
            raise ValueError(
                f"publish got version={version}; expected a version above the last one "
                f"({self.trainer_version})."
            )
        if self.lag == 0:
            self.trainer_version = version
            if self.engine is not None:
                self.engine.update_weights_from_buckets(buckets, version)
            return
        self._install(collect_buckets(buckets), version, fresh=True)

    def _ensure_engine(self) -> RolloutEngine:
        if self.engine is not None:
            return self.engine
        if self.trainer is None or self.trainer.lightning_module is None:
            raise RuntimeError(
                "RolloutDataModule needs a Trainer with a model to build its engine."
            )
        module = self.trainer.lightning_module
        # FSDP: gathered on every rank (each rank's engine needs the weights), bucket by bucket
        actor: nn.Module = unsharded_copy(module.actor, bucket_bytes=module_bucket_bytes(module))
        factory = self.engine_factory or EmbeddedEngine
        engine = factory(actor)
        if self.trainer.global_rank:
            engine.offset_seed(self.trainer.global_rank)  # ranks do not share sampling noise
        if self.lag and not self._history:
            self._history[0] = _cpu_copy(actor.state_dict())  # the lagged engine starts here
        behavior_version = max(0, self.trainer_version - self.lag)
        if self.lag and behavior_version in self._history:
            engine.update_weights(self._history[behavior_version], behavior_version)
        elif self.lag == 0 and self.trainer_version:
            engine.update_weights(actor.state_dict(), self.trainer_version)
        elif self.lag and self.trainer_version:
            raise RuntimeError(
                f"RolloutDataModule lost the weights of version {behavior_version} needed by "
                f"lag={self.lag}; the checkpoint does not carry them."
            )
        if self._engine_state is not None:
            engine.load_state_dict(self._engine_state)
            self._engine_state = None
        self.engine = engine
        return engine

    # ------------------------------------------------------------------ batches

    def next_batch(self) -> RolloutBatch:
        """The next rollout batch with a sample to train on; empty ones are skipped and counted
        (:class:`~brace_lightning.data.empty.EmptyBatchGuard`)."""
        requested_at = time.monotonic()
        while self._empty.skip(batch := self._generate_batch(), self.counters):
            pass
        batch.info.update(self._throughput.hand_out(requested_at, batch.num_actions))
        return batch

    def _generate_batch(self) -> RolloutBatch:
        """Generate, score and staleness-check one rollout batch."""
        engine = self._ensure_engine()
        prompts = self.task.sample(self.prompts_per_step, self._generator)
        batch = collect_batch(
            engine,
            prompts,
            self.tokenizer,
            reward=self.reward,
            env=self.env,
            num_samples=self.samples_per_prompt,
            group_id_offset=self._next_group,
        )
        self._next_group += len(prompts)
        generated = len(prompts) * self.samples_per_prompt
        dropped_reward = int(batch.info.get("dropped_reward_error", 0))
        staleness = self.trainer_version - batch.min_versions()
        keep = batch.mask.any(dim=1)
        dropped_empty = int((~keep).sum())
        stale = keep & (staleness > self.max_staleness) if self.max_staleness is not None else None
        if stale is not None:
            keep &= ~stale
        dropped_stale = 0 if stale is None else int(stale.sum())
        if not bool(keep.all()):
            batch = batch.select(keep)
        self.counters["generated"] += generated
        self.counters["dropped_reward_error"] += dropped_reward
        self.counters["dropped_stale"] += dropped_stale
        self.counters["dropped_empty"] += dropped_empty
        self.counters["trained"] += len(batch)
        batch.info.update(
            {
                "staleness_mean": float(staleness[keep].float().mean()) if len(batch) else 0.0,
                "staleness_max": float(staleness[keep].max()) if len(batch) else 0.0,
                "engine_version": float(engine.version),
                "trainer_version": float(self.trainer_version),  # at consume time
                "temperature": float(engine.temperature),
                **{f"count/{name}": float(value) for name, value in self.counters.items()},
            }
        )
        return batch


def seed_for_rank(datamodule: Any) -> None:
    """Give data-parallel rank r > 0 its own prompt stream, seeded ``seed + r`` (once).

    Rank 0 keeps the stream of a single-process run; a resumed run then loads every rank's own
    stream from the checkpoint (:func:`gather_rank_states`).
    """
    trainer = datamodule.trainer
    if trainer is None or trainer.global_rank == 0 or getattr(datamodule, "_rank_seeded", False):
        return
    datamodule._generator.manual_seed(datamodule.seed + trainer.global_rank)
    datamodule._rank_seeded = True


def gather_rank_states(datamodule: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as is in a single process; with several ranks ``{"per_rank": [state of rank 0,
    ...]}`` (a collective), because Lightning saves only rank 0's copy of the data module's state
    and every rank has its own prompt stream, engine RNG and buffered samples."""
    trainer = datamodule.trainer
    if trainer is None or trainer.world_size == 1:
        return state
    per_rank: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(per_rank, state)
    return {"per_rank": per_rank}


def rank_state(datamodule: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of a :func:`gather_rank_states` checkpoint.

    Raises:
        ValueError: when the checkpoint was written by a different number of ranks.
    """
    trainer = datamodule.trainer
    world_size = 1 if trainer is None else trainer.world_size
    per_rank = state_dict.get("per_rank", [state_dict])
    if len(per_rank) != world_size:
        raise ValueError(
            f"the data module's checkpoint holds the state of {len(per_rank)} rank(s); expected "
            f"{world_size} (resume with the world size that wrote it)."
        )
    return per_rank[0 if trainer is None else trainer.global_rank]


def _cpu_copy(weights: Mapping[str, torch.Tensor], fresh: bool = False) -> dict[str, torch.Tensor]:
    """CPU copies of ``weights``; ``fresh`` weights (new CPU tensors nobody else keeps) as they are."""
    if fresh:
        return dict(weights)
    return {name: value.detach().to("cpu", copy=True) for name, value in weights.items()}
