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
from torchmetrics import MetricCollection

from brace_lightning import optim, step_metrics
from brace_lightning.checks import blame
from brace_lightning.console import quiet_lightning
from brace_lightning.data.base import PublishTarget
from brace_lightning.data.resume import RECORD_KEY, check_same_data_module, data_module_name
from brace_lightning.equal_rewards import EqualRewards
from brace_lightning.evaluation import log_evaluation_batch
from brace_lightning.hparams import (
    COMPONENTS,
    check_ewma_support,
    check_module_arguments,
    from_config,
    log_final_hparams,
    save_component_configs,
)
from brace_lightning.metrics import HorizonBeta, critic_scores
from brace_lightning.models import build
from brace_lightning.models.copies import EwmaPolicy, ReferencePolicy, upgrade_checkpoint_keys
from brace_lightning.models.handoff import ActorHandoff
from brace_lightning.models.health import require_finite_logprobs, require_finite_loss
from brace_lightning.models.lora import LoraSettings
from brace_lightning.models.microbatch import MicroBatch, widen
from brace_lightning.models.sources import TINY, load_tokenizer
from brace_lightning.models.weight_sync import DEFAULT_BUCKET_MB, bucket_bytes_from_mb, drain
from brace_lightning.objectives import ActorObjective, CriticLoss, PPOClip
from brace_lightning.objectives.aggregation import LossAggregation
from brace_lightning.objectives.functional import kl_to_reference
from brace_lightning.ranks import Ranks
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.scorer import Scored, Scorer, shift_values
from brace_lightning.seeds import restore_rng_state, rng_state, run_seed
from brace_lightning.step_metrics import PhaseTimer, UpdateStats, log_training_step, masked_mean
from brace_lightning.step_size import ActorStepSize, actor_lr_scale
from brace_lightning.targets import BRACE, ValueTarget


class BraceModule(pl.LightningModule):
    """Asynchronous PPO for causal LMs with a pluggable critic target and actor objective.

    Args:
        actor: ``"tiny-char"`` (built-in tiny Qwen2 + character tokenizer), a local model folder or
            a Hugging Face hub name.
        value_target: the advantage estimator and critic target (``brace_lightning.targets``:
            ``GAE``, ``VTrace``, ``BRACE``; or ``GRPO``, ``DrGRPO``, ``RLOO``: no critic at all).
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
        whiten_advantages: normalise advantages to zero mean and unit variance over the batch;
            None (default): only with a critic (a group-relative target is its own normalisation).
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
        actor_step_size: the actor's lr times a factor from the batch's ESS or staleness (VCPO).
        log_version_drift: log ``kl/version_drift_k3`` (one more actor forward per step).
        loss_aggregation: the actor loss over the step's tokens: ``"token_mean"`` (default),
            ``"seq_mean_token_sum"``, ``"seq_mean_token_mean"`` (``objectives/aggregation.py``).
        loss_max_len: ``seq_mean_token_sum``'s constant divisor L (Dr. GRPO; None: 1).
        lora: LoRA adapters, the only weights trained (``docs/lora.md``); None (default): all.
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
        whiten_advantages: bool | None = None,
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
        actor_step_size: ActorStepSize | None = None,
        log_version_drift: bool = False,
        loss_aggregation: str = "token_mean",
        loss_max_len: int | None = None,
        lora: LoraSettings | None = None,
    ) -> None:
        super().__init__()
        quiet_lightning()  # tips and dataloader_iter notes, also for Python-API users (console.py)
        check_module_arguments(locals())
        # load_from_checkpoint passes the saved class_path configs (brace_lightning/hparams.py).
        value_target = from_config(value_target, ValueTarget, "value_target")
        actor_objective = from_config(actor_objective, ActorObjective, "actor_objective")
        critic_loss = from_config(critic_loss, CriticLoss, "critic_loss")
        if actor_step_size is not None:
            actor_step_size = from_config(actor_step_size, ActorStepSize, "actor_step_size")
        check_ewma_support(actor_objective.ewma_decay, fsdp_meta_init=fsdp_meta_init)
        self.save_hyperparameters()
        save_component_configs(self, COMPONENTS)
        self.seed = seed = run_seed(seed)  # hparams keep None: the seed follows seed_everything
        self.automatic_optimization = False
        self.value_target = value_target
        self.actor_objective, self.critic_loss = actor_objective, critic_loss
        self._optimizers = optim.with_defaults(actor_optimizer, critic_optimizer)
        self._schedulers = (actor_scheduler, critic_scheduler)
        self.ppo_epochs, self.num_minibatches = ppo_epochs, num_minibatches
        self.scorer = Scorer(
            micro_batch_size=micro_batch_size,
            max_tokens=max_tokens_per_micro_batch,
            pack_sequences=pack_sequences,
        )
        self.critic_warmup_steps = critic_warmup_steps if value_target.needs_critic else 0
        self.max_grad_norm = max_grad_norm
        whiten = value_target.needs_critic if whiten_advantages is None else whiten_advantages
        self.whiten_advantages = whiten
        self.equal_rewards = EqualRewards(skip_equal_reward_batches, mask_equal_reward_groups)
        self.activation_checkpointing = activation_checkpointing
        self.fsdp_mixed_precision, self.fsdp_cpu_offload = fsdp_mixed_precision, fsdp_cpu_offload
        self.weight_sync_bucket_bytes = bucket_bytes_from_mb(weight_sync_bucket_mb)
        self.kl_coef, self.kl_estimator, self.kl_mode = float(kl_coef), kl_estimator, kl_mode
        self.actor_step_size, self.log_version_drift = actor_step_size, log_version_drift
        self.aggregation = LossAggregation(loss_aggregation, loss_max_len)
        self.tokenizer = load_tokenizer(actor)
        self.actor, self.critic, self._meta = build.build_actor_critic(
            actor,
            tokenizer=self.tokenizer,
            hidden_size=tiny_hidden_size,
            num_layers=tiny_num_layers,
            seed=seed,
            critic_from_actor=critic_from_actor,
            meta_init=fsdp_meta_init,
            with_critic=value_target.needs_critic,
            lora=lora,
        )
        decay = actor_objective.ewma_decay
        self.ewma = None if decay is None else EwmaPolicy(self.actor, decay)
        # Only with kl_coef > 0; captured at the first training step (_next_batch).
        self.reference = ReferencePolicy(self.actor) if self.kl_coef > 0 else None
        # β needs no ground truth, so every run logs it (paper Fig. 2b); reset every rollout step.
        self.horizon_beta = HorizonBeta()
        self.val_critic = critic_scores(prefix="val/")
        self.test_critic = critic_scores(prefix="test/")
        self.policy_version, self.rollout_step = 0, 0
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
            build.refuse_meta_init_without_fsdp(trainer, bool(self.hparams.get("fsdp_meta_init")))
            if self.activation_checkpointing:
                build.checkpoint_actor_critic(self.actor, self.critic)
        else:
            check_ewma_support(self.actor_objective.ewma_decay, fsdp=True)
            build.shard_actor_critic(
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
        self.scorer.prepare(self.actor, self.critic, copies, self.value_target)

    def configure_optimizers(self) -> Any:
        return optim.configure_optimizers(
            self.actor, self.critic, self._optimizers, self._schedulers
        )

    # ------------------------------------------------------------------ the step

    def training_step(self, dataloader_iter: Iterator) -> None:
        batch = self._next_batch(dataloader_iter)
        timer = PhaseTimer()
        with torch.no_grad(), timer("old_forward"):
            plan = self.scorer.plan(batch.attention_mask, self.ranks.reduce_max)
            batch, scored, kl_metrics = self._score(batch, plan)
        due = self.rollout_step >= self.critic_warmup_steps
        train_actor = self.equal_rewards.actor_steps(due, batch.scores, self.ranks.reduce_max)
        lr_scale = actor_lr_scale(self, batch, scored, kl_metrics)
        stats = UpdateStats()
        # One global step and one scheduler step per rollout step (optim.py).
        with timer("update"), optim.rollout_update(self, (train_actor, True)):
            for _ in range(self.ppo_epochs):
                order = torch.randperm(len(batch), generator=self._shuffle).to(self.device)
                for rows in order.tensor_split(self.num_minibatches):
                    if len(rows):
                        mb, mb_scored = batch.select(rows), scored.rows(rows)
                        self._update(mb, mb_scored, train_actor, lr_scale, stats)
        if train_actor and self.log_version_drift:
            kl_metrics |= step_metrics.version_drift(
                self.scorer, self.actor, batch, plan, scored.proximal
            )
        self.rollout_step += 1
        with timer("weight_sync"):
            if train_actor:
                self.policy_version += 1
                self._publish()
        log_training_step(self, batch, scored, stats, kl_metrics, timer)

    def _next_batch(self, dataloader_iter: Iterator) -> RolloutBatch:
        batch, _, _ = next(dataloader_iter)
        batch = batch.to(self.device)
        batch.require_actions(self.rollout_step)
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
        start = time.perf_counter()  # timed with the norms a target may read (VCPO's baseline)
        inputs = self.scorer.target_inputs(
            self.value_target, self.actor, batch, plan, temperature, self.aggregation.weigh
        )
        with blame(self.rollout_step, self.value_target):
            targets = self.value_target(
                **inputs,
                rewards=batch.rewards,
                values=old_values,
                target_logprobs=proximal,
                behavior_logprobs=batch.behavior_logprobs,
                mask=batch.mask,
                group_ids=batch.group_ids,
            )
        metrics["time/value_target_ms"] = (time.perf_counter() - start) * 1e3
        advantages, actions = self.equal_rewards.policy_advantages(targets.advantages, batch)
        if self.whiten_advantages:
            advantages = self.ranks.whiten(advantages, actions)
        scored = Scored(proximal, ewma, reference, old_values, targets.returns, advantages)
        return batch, scored, metrics

    def _update(
        self,
        mb: RolloutBatch,
        scored: Scored,
        train_actor: bool,
        lr_scale: float | None,
        stats: UpdateStats,
    ) -> None:
        """One optimizer step of critic (and actor) on minibatch ``mb``, over micro-batches;
        ``scored.reference`` (log π_ref, ``kl_mode="loss"``) adds kl_coef · KL(π‖π_ref) to the
        actor's token loss, aggregated like it (``loss_aggregation``)."""
        actor_opt, critic_opt = optim.optimizers_by_network(self)
        world_size = self.trainer.world_size
        tokens = self.ranks.global_count(mb.mask)
        scale = world_size / tokens  # DDP averages gradients over ranks
        actor_scale = self.ranks.loss_scale(mb.mask, self.aggregation.mode, tokens)
        temperature = float(mb.info.get("temperature", 1.0))
        width = mb.input_ids.shape[1]
        for micro in self.scorer.plan(mb.attention_mask, self.ranks.reduce_max):
            rows, cols = micro.rows, micro.columns
            ids, attn, mask = mb.input_ids[rows, cols], mb.attention_mask[rows, cols], mb.mask[rows]
            if critic_opt is not None:
                values = widen(self.scorer.values(self.critic, ids, attn), cols, width)
                with blame(self.rollout_step, self.critic_loss):
                    critic_out = self.critic_loss(
                        values=shift_values(values),
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
            with blame(self.rollout_step, self.actor_objective):
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
                    kl_part = self.aggregation.weigh(self.kl_coef * kl, mask).detach().sum()
                    stats.add("actor/kl_ref_loss", kl_part * actor_scale / world_size)
            actor_loss = self.aggregation.weigh(token_loss, mask).sum() * actor_scale * micro.weight
            self._backward("actor loss", actor_loss)
            if micro.weight:
                stats.add("actor/loss", actor_loss.detach() / world_size)
                stats.add_objective("actor", actor_out.stats, tokens)
        stats.end_minibatch(self.ranks.reduce_stats(stats.minibatch))
        if critic_opt is not None:
            stats.append("critic/grad_norm", self._clipped_step(self.critic, critic_opt))
        if train_actor:
            stats.append("actor/grad_norm", self._clipped_step(self.actor, actor_opt, lr_scale))
            if self.ewma is not None:
                self.ewma.update(self.actor)

    def validation_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        """Log on-policy rollouts of held-out prompts: reward, mean@n, pass@k, the critic's scores."""
        self._evaluate(batch.to(self.device), self.val_critic, "val")

    def test_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        """As :meth:`validation_step`, logged under ``test/``."""
        self._evaluate(batch.to(self.device), self.test_critic, "test")

    def _evaluate(self, batch: RolloutBatch, critic: MetricCollection, prefix: str) -> None:
        values = None if self.critic is None else self.critic(batch.input_ids, batch.attention_mask)
        log_evaluation_batch(self, batch, values, critic, prefix)

    # ------------------------------------------------------------------ helpers

    def _clipped_step(
        self, model: nn.Module, optimizer: Any, lr_scale: float | None = None
    ) -> torch.Tensor:
        return optim.clipped_step(model, optimizer, self.max_grad_norm, self.device, lr_scale)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        optim.clip_before_step(optimizer)  # gradients unscaled by the precision plugin (optim.py)

    def _backward(self, what: str, loss: torch.Tensor) -> None:
        require_finite_loss(what, loss, rollout_step=self.rollout_step)
        self.manual_backward(loss)

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
