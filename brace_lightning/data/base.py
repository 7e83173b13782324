"""What both rollout data modules share: the two methods the module calls, the common arguments,
per-rank prompt streams and checkpoints, and validation rollouts.

Data flows one way. The module builds an :class:`~brace_lightning.models.handoff.ActorHandoff` and
hands it over once (:meth:`PublishTarget.connect`, from ``BraceModule.setup``); the data module
builds its engines from it. After every actor update the module calls
:meth:`PublishTarget.publish` with the new weights as a stream of buckets and their version. A data
module never reads ``trainer.lightning_module``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
from brace_lightning.models.handoff import ActorHandoff
from brace_lightning.rollout.embedded import EmbeddedEngine
from brace_lightning.rollout.engine import RolloutEngine
from brace_lightning.rollout.multiturn import check_reward_or_env, collect_batch
from brace_lightning.rollout.reward_timeout import check_reward_timeout
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.seeds import run_seed
from brace_lightning.tasks.base import Prompt, PromptSource, RewardFunction
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


class PublishTarget(pl.LightningDataModule):
    """A data module the trainer module hands weights to (test doubles subclass this alone).

    ``connect(handoff)`` comes once, before the first batch; ``publish(buckets, version)`` after
    every actor update, with the buckets of ``handoff.buckets()`` (valid only during the call:
    copy what you keep).
    """

    _handoff: ActorHandoff | None = None

    def connect(self, handoff: ActorHandoff) -> None:
        """Keep the actor's hand-off: engines (and validation engines) are built from it."""
        self._handoff = handoff

    @property
    def handoff(self) -> ActorHandoff:
        """The connected hand-off.

        Raises:
            RuntimeError: before :meth:`connect`.
        """
        if self._handoff is None:
            raise RuntimeError(
                f"{type(self).__name__} has no actor to build its engine from; expected "
                "connect(handoff) first (BraceModule.setup does it when this is the Trainer's "
                "datamodule)."
            )
        return self._handoff

    def publish(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        """The trainer finished policy ``version``; ``buckets`` together are its full state dict.

        The caller runs the stream to its end afterwards (a collective under FSDP2).
        """
        raise NotImplementedError


class RolloutDataModuleBase(PublishTarget):
    """The arguments and hooks both rollout data modules share (see their docstrings for the
    arguments; ``lag`` and ``max_staleness`` are checked by each, their rules differ).

    ``reward_timeout`` (seconds per sample, None = no limit) bounds every verifier call of
    training and validation rollouts (``rollout/reward_timeout.py``).
    """

    def collect(
        self, engine: RolloutEngine, prompts: Sequence[Prompt], *, group_id_offset: int
    ) -> RolloutBatch:
        """Generate ``samples_per_prompt`` responses to each of ``prompts`` with ``engine`` and
        score them (the task's reward, or the tool environment's episodes)."""
        return collect_batch(
            engine,
            prompts,
            self.tokenizer,
            reward=self.reward,
            env=self.env,
            num_samples=self.samples_per_prompt,
            group_id_offset=group_id_offset,
            reward_timeout=self.reward_timeout,
        )

    def __init__(
        self,
        *,
        task: PromptSource,
        reward: RewardFunction | None,
        env: ToolEnvironment | None,
        tokenizer: str,
        engine: EngineFactory | None,
        prompts_per_step: int,
        samples_per_prompt: int,
        lag: int | None,
        max_staleness: int | None,
        seed: int | None,
        val_batches: int,
        max_consecutive_empty_batches: int,
        reward_timeout: float | None = None,
    ) -> None:
        super().__init__()
        self._empty = EmptyBatchGuard(max_consecutive_empty_batches)
        self._throughput = TokenThroughput()
        for name, value, low in (
            ("prompts_per_step", prompts_per_step, 1),
            ("samples_per_prompt", samples_per_prompt, 1),
            ("val_batches", val_batches, 0),
        ):
            require_int(name, value, low)
        check_reward_or_env(reward, env)
        self.reward_timeout = check_reward_timeout(reward_timeout)
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
        self.trainer_version = 0
        self._generator = torch.Generator().manual_seed(seed)
        self._next_group = 0
        self._rank_seeded = False

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, stage: str) -> None:
        self._seed_for_rank()
        # With val_batches=0 a fit has no validation: tell the trainer so instead of handing it an
        # empty loader, for which Lightning warns that the loader has zero length on every rank.
        if stage == "fit" and self.val_batches == 0 and self.trainer is not None:
            self.trainer.limit_val_batches = 0

    def train_dataloader(self) -> DataLoader:
        # batch_size=None: the stream yields whole batches; no worker processes, because engines
        # and requests must see the weights published by the training process after every step.
        return DataLoader(_RolloutStream(self), batch_size=None, num_workers=0)

    def val_dataloader(self) -> Any:
        """``val_batches`` on-policy batches (an empty list when 0: no validation)."""
        if self.val_batches == 0:
            return []
        rollouts = _ValidationRollouts(self, self.val_batches, self.seed + 1)
        return DataLoader(rollouts, batch_size=None, num_workers=0)

    def next_batch(self) -> RolloutBatch:
        """The next rollout batch to train on."""
        raise NotImplementedError

    # ------------------------------------------------------------------ ranks

    def _seed_for_rank(self) -> None:
        """Give data-parallel rank r > 0 its own prompt stream, seeded ``seed + r`` (once).

        Rank 0 keeps the stream of a single-process run; a resumed run then loads every rank's own
        stream from the checkpoint (:meth:`_gather_rank_states`).
        """
        trainer = self.trainer
        if trainer is None or trainer.global_rank == 0 or self._rank_seeded:
            return
        self._generator.manual_seed(self.seed + trainer.global_rank)
        self._rank_seeded = True

    def _group_id_offset(self, num_prompts: int) -> int:
        """The ``group_id_offset`` of this rank's next ``num_prompts`` prompts, advancing the
        count: rank r of W takes the ids ``next + r·P … next + (r+1)·P − 1``, so group ids are
        unique over ranks and steps. A group never spans ranks (each rank samples its own prompts
        and all their responses), so the group-relative targets need no reduction over ranks."""
        trainer = self.trainer
        rank, world = (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)
        offset = self._next_group + rank * num_prompts
        self._next_group += num_prompts * world
        return offset

    def _gather_rank_states(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` as is in a single process; with several ranks ``{"per_rank": [state of rank
        0, ...]}`` (a collective), because Lightning saves only rank 0's copy of the data module's
        state and every rank has its own prompt stream, engine RNG and buffered samples."""
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1:
            return state
        per_rank: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(per_rank, state)
        return {"per_rank": per_rank}

    def _rank_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of a :meth:`_gather_rank_states` checkpoint.

        Raises:
            ValueError: when the checkpoint was written by a different number of ranks.
        """
        trainer = self.trainer
        world_size = 1 if trainer is None else trainer.world_size
        per_rank = state_dict.get("per_rank", [state_dict])
        if len(per_rank) != world_size:
            raise ValueError(
                f"the data module's checkpoint holds the state of {len(per_rank)} rank(s); "
                f"expected {world_size} (resume with the world size that wrote it)."
            )
        return per_rank[0 if trainer is None else trainer.global_rank]


class _RolloutStream(IterableDataset):
    """Endless stream of rollout batches produced by ``datamodule.next_batch()``."""

    def __init__(self, datamodule: RolloutDataModuleBase) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[RolloutBatch]:
        while True:
            yield self.datamodule.next_batch()


class _ValidationRollouts(IterableDataset):
    """``num_batches`` rollout batches sampled with the trainer's *current* actor weights.

    Every validation pass draws the same prompts (a generator seeded with ``seed``) and builds a
    fresh engine from the hand-off, so the rows are on-policy: their realized returns are unbiased
    Monte-Carlo estimates of V^π, the reference of the critic's ``val/value_gap_mc``.
    """

    def __init__(self, datamodule: RolloutDataModuleBase, num_batches: int, seed: int) -> None:
        self.datamodule = datamodule
        self.num_batches = num_batches
        self.seed = seed

    def __iter__(self) -> Iterator[RolloutBatch]:
        dm = self.datamodule
        engine = (dm.engine_factory or EmbeddedEngine)(dm.handoff.engine_model())
        generator = torch.Generator().manual_seed(self.seed)
        try:
            for index in range(self.num_batches):
                prompts = dm.task.sample(dm.prompts_per_step, generator)
                yield dm.collect(engine, prompts, group_id_offset=index * len(prompts))
        finally:
            engine.close()
