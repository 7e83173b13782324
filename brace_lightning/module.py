"""The LightningModule: actor + critic, one PPO update per rollout batch.

``training_step`` takes one rollout batch from the data module's iterator (nothing is prefetched
with stale weights) and reads like the algorithm: **score** (no grad: log π at the start of the
step, the critic's V, the EWMA and reference log-probs; ``kl_mode="reward"`` puts −kl_coef·KL on the
rewards) → **value target** (GAE, V-trace or BRACE: advantages, whitened, and critic targets) →
**PPO epochs × minibatches** (one optimizer step of the critic and, after ``critic_warmup_steps``,
the actor per minibatch; token losses summed over micro-batches and divided by the minibatch's
global action-token count, so accumulation and data parallelism give one big batch's gradient) →
**publish** the actor's weights (a new policy version) → **log**. No actor step on a batch whose
rewards are all equal (``equal_rewards.py``); the plumbing's homes: ``docs/architecture.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from jsonargparse import lazy_instance
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule

from brace_lightning.console import quiet_lightning
from brace_lightning.data.base import PublishTarget
from brace_lightning.data.resume import RECORD_KEY, check_same_data_module, data_module_name
from brace_lightning.equal_rewards import EqualRewards
from brace_lightning.hparams import (
    check_ewma_support,
    check_module_arguments,
    from_config,
    log_final_hparams,
    save_component_configs,
)
from brace_lightning.metrics import HorizonBeta, ValueBiasGap
from brace_lightning.metrics.functional import reward_to_go
from brace_lightning.models.build import build_actor_critic, shard_actor_critic
from brace_lightning.models.copies import EwmaPolicy, ReferencePolicy, upgrade_checkpoint_keys
from brace_lightning.models.handoff import ActorHandoff
from brace_lightning.models.health import require_finite_logprobs, require_finite_loss
from brace_lightning.models.microbatch import MicroBatch, widen
from brace_lightning.models.parallelize import checkpoint_activations
from brace_lightning.models.sources import TINY, load_tokenizer
from brace_lightning.models.weight_sync import (
    DEFAULT_BUCKET_MB,
    bucket_bytes_from_mb,
    drain,
)
from brace_lightning.objectives import ActorObjective, CriticLoss, PPOClip
from brace_lightning.objectives.functional import kl_to_reference
from brace_lightning.optim import adamw, clip_before_step, clipped_step, rollout_update
from brace_lightning.ranks import Ranks
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.scorer import Scored, Scorer
from brace_lightning.seeds import restore_rng_state, rng_state, run_seed
from brace_lightning.step_metrics import PhaseTimer, UpdateStats, log_training_step, masked_mean
from brace_lightning.targets import BRACE, ValueTarget


def shift_values(values: torch.Tensor) -> torch.Tensor:
    """Critic outputs ``[B, T]`` (value of the prefix ending at t) → value of the state before the
    token at t, stored at column t (column 0 gets 0)."""
    return torch.nn.functional.pad(values[:, :-1], (1, 0))


class BraceModule(pl.LightningModule):
    """Asynchronous PPO for causal LMs with a pluggable critic target and actor objective.

    Args:
        actor: ``"tiny-char"`` (built-in tiny Qwen2 + character tokenizer), a local model folder or
            a Hugging Face hub name.
        value_target: the critic's regression target and the advantage estimator
            (``brace_lightning.targets.GAE`` / ``VTrace`` / ``BRACE``).
        actor_objective: the actor loss (``brace_lightning.objectives.PPOClip`` and the stabilizers).
        critic_loss: the critic loss (clipped value loss, ε_v = 0.5 by default).
        actor_optimizer: builds the actor's optimizer; default AdamW(lr=1e-6) (paper).
        critic_optimizer: builds the critic's optimizer; default AdamW(lr=1e-5) (paper).
        actor_scheduler: optional LR scheduler of the actor's optimizer (stepped once per rollout step
            in which the actor stepped, so its period is in rollout steps).
        critic_scheduler: optional LR scheduler of the critic's optimizer.
        critic_from_actor: initialise the critic's backbone from the actor's (else random).
        ppo_epochs: passes over each rollout batch.
        num_minibatches: optimizer steps per pass (the batch's rows are split evenly).
        micro_batch_size: rows per forward/backward inside a minibatch (None = the whole minibatch).
        max_tokens_per_micro_batch: padded tokens (rows × width) per forward/backward, or real
            tokens with ``pack_sequences``, also for the scoring forwards (``models/microbatch.py``;
            None = no budget).
        pack_sequences: run every forward on packed rows (the real tokens of a micro-batch as one
            row; same losses and gradients as padded rows; ``models/packing.py``). A model that
            cannot pack keeps padded rows, with one logged sentence.
        critic_warmup_steps: rollout steps during which only the critic is trained.
        max_grad_norm: gradient-norm clip applied to actor and critic separately (None = off).
        whiten_advantages: normalise advantages to zero mean and unit variance over the batch.
        skip_equal_reward_batches: no actor step on a batch whose rewards are all equal (counted).
        mask_equal_reward_groups: advantage 0 in prompt groups whose rewards are all equal (DAPO).
        tiny_hidden_size: width of the ``"tiny-char"`` model (multiple of 32).
        tiny_num_layers: depth of the ``"tiny-char"`` model.
        seed: seed of the tiny model's initialisation and of the minibatch shuffling (None: the
            run's ``seed_everything``, see ``brace_lightning.seeds``).
        activation_checkpointing: recompute each transformer block's activations of actor and
            critic in the backward pass (less memory, one more forward).
        fsdp_mixed_precision: under FSDP2, ``"auto"`` (bf16 parameters and fp32 reduction on GPU,
            fp32 on CPU), ``"bf16"`` or ``"fp32"``; value head, log-probs and values stay fp32.
        fsdp_cpu_offload: under FSDP2, keep shards, gradients and optimizer states in host memory.
        fsdp_meta_init: under FSDP2, build actor and critic on the meta device; each rank then
            allocates and reads only its shards (``docs/fsdp.md``).
        weight_sync_bucket_mb: the actor's weights reach the engines in buckets of at most this
            many MiB (under FSDP2 gathered a bucket at a time); None: one whole state dict.
        kl_coef: weight of the KL to π_ref, the actor as RL training starts; 0 (default): none.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (default): the per-token KL(π‖π_ref) estimator.
        kl_mode: ``"loss"`` (default; verl): KL in the actor loss; ``"reward"``: on the rewards.
    """

    def __init__(
        self,
        *,
        actor: str = TINY,
        value_target: ValueTarget = lazy_instance(BRACE),
        actor_objective: ActorObjective = lazy_instance(PPOClip),
        critic_loss: CriticLoss = lazy_instance(CriticLoss),
        actor_optimizer: OptimizerCallable | None = None,
        critic_optimizer: OptimizerCallable | None = None,
        actor_scheduler: LRSchedulerCallable | None = None,
        critic_scheduler: LRSchedulerCallable | None = None,
        critic_from_actor: bool = True,
        ppo_epochs: int = 1,
        num_minibatches: int = 1,
        micro_batch_size: int | None = None,
        max_tokens_per_micro_batch: int | None = None,
        pack_sequences: bool = True,
        critic_warmup_steps: int = 5,
        max_grad_norm: float | None = 1.0,
        whiten_advantages: bool = True,
        skip_equal_reward_batches: bool = True,
        mask_equal_reward_groups: bool = False,
        tiny_hidden_size: int = 128,
        tiny_num_layers: int = 2,
        seed: int | None = None,
        activation_checkpointing: bool = False,
        fsdp_mixed_precision: str = "auto",
        fsdp_cpu_offload: bool = False,
        fsdp_meta_init: bool = False,
        weight_sync_bucket_mb: int | None = DEFAULT_BUCKET_MB,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        kl_mode: str = "loss",
    ) -> None:
        super().__init__()
        quiet_lightning()  # tips and dataloader_iter notes, also for Python-API users (console.py)
        check_module_arguments(locals())
        # load_from_checkpoint passes the saved class_path configs (brace_lightning/hparams.py).
        value_target = from_config(value_target, ValueTarget, "value_target")
        actor_objective = from_config(actor_objective, ActorObjective, "actor_objective")
        critic_loss = from_config(critic_loss, CriticLoss, "critic_loss")
        check_ewma_support(actor_objective.ewma_decay, fsdp_meta_init=fsdp_meta_init)
        self.save_hyperparameters()
        save_component_configs(self, ("value_target", "actor_objective", "critic_loss"))
        self.seed = seed = run_seed(seed)  # hparams keep None: the seed follows seed_everything
        self.automatic_optimization = False
        self.value_target = value_target
        self.actor_objective = actor_objective
        self.critic_loss = critic_loss
        self._optimizers = (actor_optimizer or adamw(1e-6), critic_optimizer or adamw(1e-5))
        self._schedulers = (actor_scheduler, critic_scheduler)
        self.ppo_epochs = ppo_epochs
        self.num_minibatches = num_minibatches
        self.scorer = Scorer(
            micro_batch_size=micro_batch_size,
            max_tokens=max_tokens_per_micro_batch,
            pack_sequences=pack_sequences,
        )
        self.critic_warmup_steps = critic_warmup_steps
        self.max_grad_norm = max_grad_norm
        self.whiten_advantages = whiten_advantages
        self.equal_rewards = EqualRewards(skip_equal_reward_batches, mask_equal_reward_groups)
        self.activation_checkpointing = activation_checkpointing
        self.fsdp_mixed_precision = fsdp_mixed_precision
        self.fsdp_cpu_offload = fsdp_cpu_offload
        self.weight_sync_bucket_bytes = bucket_bytes_from_mb(weight_sync_bucket_mb)
        self.kl_coef = float(kl_coef)
        self.kl_estimator = kl_estimator
        self.kl_mode = kl_mode
        self.tokenizer = load_tokenizer(actor)
        self.actor, self.critic, self._meta = build_actor_critic(
            actor,
            tokenizer=self.tokenizer,
            hidden_size=tiny_hidden_size,
            num_layers=tiny_num_layers,
            seed=seed,
            critic_from_actor=critic_from_actor,
            meta_init=fsdp_meta_init,
        )
        self.ewma: EwmaPolicy | None = None
        if actor_objective.ewma_decay is not None:
            self.ewma = EwmaPolicy(self.actor, actor_objective.ewma_decay)
        # Only with kl_coef > 0; captured at the first training step (_next_batch).
        self.reference = ReferencePolicy(self.actor) if self.kl_coef > 0 else None
        # β needs no ground truth, so every run logs it (paper Fig. 2b); reset every rollout step.
        self.horizon_beta = HorizonBeta()
        # ĝ_π against Monte-Carlo returns of fresh on-policy rollouts (the validation batches).
        self.val_value_gap = ValueBiasGap()
        self.policy_version = 0
        self.rollout_step = 0
        self._shuffle = torch.Generator().manual_seed(seed)

    @property
    def reference_actor(self) -> nn.Module | None:
        """The frozen reference policy π_ref (None without a KL term)."""
        return None if self.reference is None else self.reference.policy

    @property
    def ewma_actor(self) -> nn.Module | None:
        """The PPO-EWMA actor (None without ``actor_objective.ewma_decay``)."""
        return None if self.ewma is None else self.ewma.policy

    @property
    def ranks(self) -> Ranks:
        """The data-parallel reductions over the trainer's ranks (``ranks.py``)."""
        return Ranks(self.trainer)

    # ------------------------------------------------------------------ parallelism

    def configure_model(self) -> None:
        """Shard actor, critic (and the reference policy, if any) with FSDP2 under
        ``ModelParallelStrategy`` (else only ``activation_checkpointing``, if asked), then decide
        packing once (``Scorer.prepare``). Idempotent: Lightning may call it more than once."""
        trainer = self._trainer
        if trainer is None or not isinstance(trainer.strategy, ModelParallelStrategy):
            if trainer is not None and self.hparams.get("fsdp_meta_init"):
                raise ValueError(
                    "fsdp_meta_init=True needs trainer.strategy ModelParallelStrategy (FSDP2); got "
                    f"{type(trainer.strategy).__name__}."
                )
            if self.activation_checkpointing:
                checkpoint_activations(self.actor)
                checkpoint_activations(self.critic)
        else:
            check_ewma_support(self.actor_objective.ewma_decay, fsdp=True)
            shard_actor_critic(
                self.actor,
                self.critic,
                None if self.reference is None else self.reference.policy,
                self.device_mesh,
                trainer.strategy.root_device,
                meta=self._meta,
                activation_checkpointing=self.activation_checkpointing,
                mixed_precision=self.fsdp_mixed_precision,
                cpu_offload=self.fsdp_cpu_offload,
            )
        copies = [c.policy for c in (self.ewma, self.reference) if c is not None]
        self.scorer.prepare(self.actor, self.critic, copies)

    def configure_optimizers(self) -> Any:
        actor_opt = self._optimizers[0](self.actor.parameters())
        critic_opt = self._optimizers[1](self.critic.parameters())
        schedulers = [
            {"scheduler": factory(opt), "interval": "step"}
            for opt, factory in zip((actor_opt, critic_opt), self._schedulers, strict=True)
            if factory is not None
        ]
        return [actor_opt, critic_opt], schedulers

    # ------------------------------------------------------------------ the step

    def training_step(self, dataloader_iter: Iterator) -> None:
        batch = self._next_batch(dataloader_iter)
        timer = PhaseTimer()
        with torch.no_grad(), timer("old_forward"):
            plan = self.scorer.plan(batch.attention_mask, self.ranks.reduce_max)
            batch, scored, kl_metrics = self._score(batch, plan)
        due = self.rollout_step >= self.critic_warmup_steps
        train_actor = self.equal_rewards.actor_steps(due, batch.scores, self.ranks.reduce_max)
        stats = UpdateStats()
        # One global step and one scheduler step per rollout step (optim.py).
        with timer("update"), rollout_update(self, (train_actor, True)):
            for _ in range(self.ppo_epochs):
                order = torch.randperm(len(batch), generator=self._shuffle).to(self.device)
                for rows in order.tensor_split(self.num_minibatches):
                    if len(rows):
                        self._update(batch.select(rows), scored.rows(rows), train_actor, stats)
        self.rollout_step += 1
        with timer("weight_sync"):
            if train_actor:
                self.policy_version += 1
                self._publish()
        log_training_step(self, batch, scored, stats, kl_metrics, timer)

    def _next_batch(self, dataloader_iter: Iterator) -> RolloutBatch:
        batch, _, _ = next(dataloader_iter)
        batch = batch.to(self.device)
        if len(batch) == 0 or batch.num_actions == 0:
            counts = {k: v for k, v in batch.info.items() if k.startswith("count/")}
            raise RuntimeError(
                f"rollout step {self.rollout_step}: the rollout batch has no action tokens "
                f"(counts: {counts}); check the task, the reward function and max_staleness."
            )
        if self.reference is not None and not self.reference.captured:
            self.reference.capture(self.actor)  # the actor as RL training starts
        return batch

    def _score(
        self, batch: RolloutBatch, plan: list[MicroBatch]
    ) -> tuple[RolloutBatch, Scored, dict[str, float]]:
        """Log-probs, values, the KL reference and the value target of ``batch`` (no grad); with
        ``kl_mode="reward"`` the returned batch's rewards carry the KL penalty."""
        temperature = float(batch.info.get("temperature", 1.0))
        proximal = self.scorer.score(self.actor, batch, plan, temperature)
        require_finite_logprobs(proximal, batch.mask, rollout_step=self.rollout_step)
        old_values = shift_values(self.scorer.score_values(self.critic, batch, plan))
        metrics: dict[str, float] = {} if self.ewma is None else {"time/ewma_forward_ms": 0.0}
        ewma = None
        if self.ewma is not None and self.ewma.ready:
            start = time.perf_counter()
            ewma = self.scorer.score(self.ewma.policy, batch, plan, temperature)
            metrics["time/ewma_forward_ms"] = (time.perf_counter() - start) * 1e3
        reference = None
        if self.reference is not None:
            start = time.perf_counter()
            reference = self.scorer.score(self.reference.policy, batch, plan, temperature)
            if isinstance(self.reference.policy, FSDPModule):
                self.reference.policy.reshard()  # no backward runs through it: free the gather
            metrics["time/reference_forward_ms"] = (time.perf_counter() - start) * 1e3
            kl = kl_to_reference(proximal, reference, batch.mask, estimator=self.kl_estimator)
            metrics["kl/ref"] = float(masked_mean(kl, batch.mask))
            if self.kl_mode == "reward":  # KL is 0 at non-actions: only actions' rewards change
                penalty = -self.kl_coef * kl
                batch = dataclasses.replace(batch, rewards=batch.rewards + penalty)
                metrics["kl/ref_penalty"] = float(penalty.sum(1).mean())
                reference = None  # the actor loss has no KL term
        start = time.perf_counter()
        with self._blame(self.value_target):
            targets = self.value_target(
                rewards=batch.rewards,
                values=old_values,
                target_logprobs=proximal,
                behavior_logprobs=batch.behavior_logprobs,
                mask=batch.mask,
            )
        metrics["time/value_target_ms"] = (time.perf_counter() - start) * 1e3
        advantages, actions = self.equal_rewards.policy_advantages(targets.advantages, batch)
        if self.whiten_advantages:
            advantages = self.ranks.whiten(advantages, actions)
        scored = Scored(proximal, ewma, reference, old_values, targets.returns, advantages)
        return batch, scored, metrics

    def _update(
        self, mb: RolloutBatch, scored: Scored, train_actor: bool, stats: UpdateStats
    ) -> None:
        """One optimizer step of critic (and actor) on minibatch ``mb``, over micro-batches.

        ``scored.reference`` (log π_ref, only with ``kl_mode="loss"``) adds kl_coef · KL(π‖π_ref)
        to the actor's token loss, summed and divided by the same global action-token count.
        """
        actor_opt, critic_opt = self.optimizers()
        world_size = self.trainer.world_size
        tokens = self.ranks.global_count(mb.mask)
        scale = world_size / tokens  # DDP averages gradients over ranks
        temperature = float(mb.info.get("temperature", 1.0))
        width = mb.input_ids.shape[1]
        for micro in self.scorer.plan(mb.attention_mask, self.ranks.reduce_max):
            rows, cols = micro.rows, micro.columns
            ids, attn, mask = mb.input_ids[rows, cols], mb.attention_mask[rows, cols], mb.mask[rows]
            values = shift_values(widen(self.scorer.values(self.critic, ids, attn), cols, width))
            with self._blame(self.critic_loss):
                critic_out = self.critic_loss(
                    values=values,
                    old_values=scored.old_values[rows],
                    returns=scored.returns[rows],
                    mask=mask,
                )
            # A filler (weight 0) only keeps the ranks' backward counts equal.
            critic_loss = critic_out.token_loss.sum() * scale * micro.weight
            self._backward("critic loss", critic_loss)
            if micro.weight:
                stats.add("critic/loss", critic_loss.detach() / world_size)
                stats.add_objective("critic", critic_out.stats, tokens)
            if not train_actor:
                continue
            logprobs = widen(self.scorer.logprobs(self.actor, ids, attn, temperature), cols, width)
            proximal = scored.proximal if scored.ewma is None else scored.ewma
            with self._blame(self.actor_objective):
                actor_out = self.actor_objective(
                    logprobs=logprobs,
                    proximal_logprobs=proximal[rows],
                    behavior_logprobs=mb.behavior_logprobs[rows],
                    advantages=scored.advantages[rows],
                    mask=mask,
                    entropy=None if mb.entropy is None else mb.entropy[rows],
                )
            token_loss = actor_out.token_loss
            if scored.reference is not None:
                kl = kl_to_reference(
                    logprobs, scored.reference[rows], mask, estimator=self.kl_estimator
                )
                token_loss = token_loss + self.kl_coef * kl
                if micro.weight:
                    kl_part = (self.kl_coef * kl).detach().sum() * scale / world_size
                    stats.add("actor/kl_ref_loss", kl_part)
            actor_loss = token_loss.sum() * scale * micro.weight
            self._backward("actor loss", actor_loss)
            if micro.weight:
                stats.add("actor/loss", actor_loss.detach() / world_size)
                stats.add_objective("actor", actor_out.stats, tokens)
        stats.end_minibatch(self.ranks.reduce_stats(stats.minibatch))
        stats.append("critic/grad_norm", self._clipped_step(self.critic, critic_opt))
        if train_actor:
            stats.append("actor/grad_norm", self._clipped_step(self.actor, actor_opt))
            if self.ewma is not None:
                self.ewma.update(self.actor)

    def validation_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        """Score on-policy rollouts (``val/reward`` = mean@samples_per_prompt, ``val/accuracy``)
        and the critic's value-bias gap to their realized returns (``val/value_gap_mc``)."""
        batch = batch.to(self.device)
        values = shift_values(self.critic(batch.input_ids, batch.attention_mask))
        realized = reward_to_go(batch.rewards, batch.mask, gamma=self.value_target.gamma)
        self.val_value_gap.update(values, realized, batch.mask)
        log = {"batch_size": len(batch)}  # "step" sets the x-axis: the rollout step, as in training
        self.log("step", float(self.rollout_step), reduce_fx="max", **log)
        self.log("val/reward", batch.scores.float().mean(), prog_bar=True, **log)
        self.log("val/response_length", batch.mask.sum(1).float().mean(), **log)
        if batch.correct is not None:
            self.log("val/accuracy", batch.correct.float().mean(), **log)
        self.log("val/value_gap_mc", self.val_value_gap, **log)

    # ------------------------------------------------------------------ helpers

    def _clipped_step(self, model: nn.Module, optimizer: Any) -> torch.Tensor:
        return clipped_step(model, optimizer, self.max_grad_norm, self.device)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        clip_before_step(optimizer)  # gradients unscaled by the precision plugin (optim.py)

    def _backward(self, what: str, loss: torch.Tensor) -> None:
        require_finite_loss(what, loss, rollout_step=self.rollout_step)
        self.manual_backward(loss)

    @contextlib.contextmanager
    def _blame(self, component: object) -> Iterator[None]:
        """Prefix a ValueError raised by ``component`` with the rollout step and the component."""
        try:
            yield
        except ValueError as error:
            raise ValueError(f"rollout step {self.rollout_step}, {component!r}: {error}") from error

    def setup(self, stage: str) -> None:
        """Build the actor's weight hand-off (the only way weights leave the trainer) and hand it
        to the Trainer's rollout data module (``models/handoff.py``)."""
        self.handoff = ActorHandoff(self.actor, bucket_bytes=self.weight_sync_bucket_bytes)
        datamodule = None if self._trainer is None else self._trainer.datamodule
        if isinstance(datamodule, PublishTarget):
            datamodule.connect(self.handoff)

    def _publish(self) -> None:
        datamodule = None if self._trainer is None else self._trainer.datamodule
        if not isinstance(datamodule, PublishTarget):
            return
        self.handoff.require_finite(rollout_step=self.rollout_step - 1)
        buckets = self.handoff.buckets()
        try:
            datamodule.publish(buckets, self.policy_version)
        finally:
            drain(buckets)  # the gathers a data module left (no engine yet, or an error)

    # ------------------------------------------------------------------ checkpoints

    def on_fit_end(self) -> None:
        log_final_hparams(self)  # HParams tab: the hyperparameters with the final metrics

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        datamodule = None if self._trainer is None else self._trainer.datamodule
        checkpoint["brace"] = {
            "policy_version": self.policy_version,
            "rollout_step": self.rollout_step,
            "shuffle": self._shuffle.get_state(),
            **rng_state(),
            RECORD_KEY: data_module_name(datamodule),
        }
        if self.reference is not None:
            checkpoint["brace"]["reference_captured"] = self.reference.captured

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["brace"]
        datamodule = None if self._trainer is None else self._trainer.datamodule
        check_same_data_module(checkpoint, state.get(RECORD_KEY), datamodule)
        upgrade_checkpoint_keys(checkpoint)
        if self.reference is not None:
            self.reference.load_checkpoint_state(checkpoint, self.kl_coef)
        else:
            ReferencePolicy.drop_from_checkpoint(checkpoint)
        self.policy_version = int(state["policy_version"])
        self.rollout_step = int(state["rollout_step"])
        self._shuffle.set_state(state["shuffle"])
        restore_rng_state(state)
