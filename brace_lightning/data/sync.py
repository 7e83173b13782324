"""The synchronous rollout data module: one fresh rollout batch per training step.

Each training step pulls one :class:`~brace_lightning.rollout.types.RolloutBatch` (the module's
``training_step`` takes the iterator, so Lightning prefetches nothing and a batch is generated only
after the previous step's weights were published). With ``lag = 0`` the engine samples with the
trainer's current weights (synchronous on-policy PPO, staleness 0). With ``lag = S`` the engine
always holds the weights of exactly S versions ago (as ``AsyncRolloutDataModule(lag=S)``),
independent of timing, so staleness sweeps are reproducible on any machine.

Staleness is re-checked when a batch is handed to the trainer: a row whose oldest token is more
than ``max_staleness`` versions old is dropped and counted (``dropped_stale``). Counts are conserved:
generated = trained + dropped (by reason); this module buffers nothing between steps.

The engine is closed (its servers stopped, its temporary folders deleted) by ``teardown`` at the end
of ``fit``/``validate`` and by ``on_exception`` when they fail or are interrupted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from brace_lightning.checks import require_int
from brace_lightning.data.base import COUNTERS, EngineFactory, RolloutDataModuleBase
from brace_lightning.rollout.buffer import partial_groups, split_stale
from brace_lightning.rollout.embedded import EmbeddedEngine
from brace_lightning.rollout.engine import RolloutEngine
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.tasks.base import PromptSource, RewardFunction
from brace_lightning.tasks.env import ToolEnvironment

__all__ = ["COUNTERS", "EngineFactory", "RolloutDataModule"]


class RolloutDataModule(RolloutDataModuleBase):
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
        reward_timeout: seconds the verifier (``reward`` or ``env``) may take per sample; a call
            that does not return in time is abandoned (its thread keeps running, at most
            ``rollout.reward_timeout.MAX_ABANDONED`` of them) and its sample dropped and counted in
            ``dropped_reward_error``; a batch whose every sample timed out stops the run. None =
            no limit (the verifier is called inline).
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
        reward_timeout: float | None = None,
    ) -> None:
        super().__init__(
            task=task,
            reward=reward,
            env=env,
            tokenizer=tokenizer,
            engine=engine,
            prompts_per_step=prompts_per_step,
            samples_per_prompt=samples_per_prompt,
            lag=lag,
            max_staleness=max_staleness,
            seed=seed,
            val_batches=val_batches,
            max_consecutive_empty_batches=max_consecutive_empty_batches,
            reward_timeout=reward_timeout,
        )
        require_int("lag", lag, 0)
        if max_staleness is not None and (
            not isinstance(max_staleness, int) or max_staleness < lag
        ):
            raise ValueError(
                f"max_staleness must be None or an integer >= lag={lag}; got {max_staleness!r}."
            )
        self.lag: int = lag
        self.engine: RolloutEngine | None = None
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        # version -> CPU weights, kept while a lagged engine may still need them
        self._history: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._engine_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ Lightning hooks

    def teardown(self, stage: str) -> None:
        if self.engine is not None:
            self.engine.close()

    def on_exception(self, exception: BaseException) -> None:
        """Stop the engine when ``fit`` or ``validate`` fails or is interrupted: Lightning skips
        ``teardown`` then, and a launched vLLM server, its engine processes and the engine's
        temporary model and weight copies would outlive the error. A later batch builds a new one.
        """
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    def state_dict(self) -> dict[str, Any]:
        return self._gather_rank_states(self._local_state_dict())

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
        state_dict = self._rank_state(state_dict)
        self._generator.set_state(state_dict["generator"])
        self.trainer_version = int(state_dict["trainer_version"])
        self.counters = {**dict.fromkeys(COUNTERS, 0), **state_dict["counters"]}
        self._next_group = int(state_dict["next_group"])
        self._history = OrderedDict(sorted(state_dict["history"].items()))
        self._engine_state = state_dict["engine"]
        self.engine = None  # rebuilt from the restored actor on the next batch

    # ------------------------------------------------------------------ weights and versions

    def publish(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        """The trainer finished version ``version`` (``buckets``: its full state dict): at
        ``lag`` 0 each bucket goes straight into the engine (``update_weights_from_buckets``);
        with a lag a CPU copy of this version is kept and the engine gets the weights of
        ``version − lag``. The caller runs the stream to its end afterwards."""
        if version <= self.trainer_version and self.engine is not None:
            raise ValueError(
                f"publish got version={version}; expected a version above the last one "
                f"({self.trainer_version})."
            )
        self.trainer_version = version
        if self.lag == 0:
            if self.engine is not None:
                self.engine.update_weights_from_buckets(buckets, version)
            return
        self._history[version] = {
            name: value.detach().to("cpu", copy=True)  # buckets are valid during this call only
            for bucket in buckets
            for name, value in bucket.items()
        }
        behavior_version = version - self.lag
        for old in [v for v in self._history if v < behavior_version]:
            del self._history[old]
        if self.engine is not None and behavior_version in self._history:
            self.engine.update_weights(self._history[behavior_version], behavior_version)

    def _ensure_engine(self) -> RolloutEngine:
        if self.engine is not None:
            return self.engine
        # FSDP: gathered on every rank (each rank's engine needs the weights), bucket by bucket
        actor = self.handoff.engine_model()
        factory = self.engine_factory or EmbeddedEngine
        engine = factory(actor)
        if self.trainer is not None and self.trainer.global_rank:
            engine.offset_seed(self.trainer.global_rank)  # ranks do not share sampling noise
        if self.lag and not self._history:
            self._history[0] = {  # the lagged engine starts here
                name: value.detach().to("cpu", copy=True)
                for name, value in actor.state_dict().items()
            }
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
        batch = self.collect(engine, prompts, group_id_offset=self._group_id_offset(len(prompts)))
        dropped_reward = int(batch.info.get("dropped_reward_error", 0))
        batch, report = split_stale(batch, self.trainer_version, self.max_staleness)
        staleness = report.staleness.float()
        self.counters["generated"] += len(prompts) * self.samples_per_prompt
        self.counters["dropped_reward_error"] += dropped_reward
        self.counters["dropped_stale"] += report.dropped_stale
        self.counters["dropped_empty"] += report.dropped_empty
        self.counters["trained"] += len(batch)
        batch.info.update(
            {
                "staleness_mean": float(staleness.mean()) if len(batch) else 0.0,
                "staleness_max": float(staleness.max()) if len(batch) else 0.0,
                "engine_version": float(engine.version),
                "trainer_version": float(self.trainer_version),  # at consume time
                "temperature": float(engine.temperature),
                **{f"count/{name}": float(value) for name, value in self.counters.items()},
            }
        )
        if partial := partial_groups(batch.group_ids, self.samples_per_prompt):
            batch.info["partial_groups"] = float(partial)
        return batch
