"""The LightningModule: actor + critic, one PPO update per rollout batch, logging.

One ``training_step`` consumes one rollout batch (pulled from the data module's iterator, so nothing
is prefetched with stale weights) and does, in this order:

1. log π of every token under the actor at the start of the step (``proximal`` / target policy),
   the critic's values V, (PPO-EWMA only) log-probs under the EWMA actor and (``kl_coef`` > 0
   only) log π_ref under the frozen reference policy — all without grad;
2. (``kl_mode="reward"`` only) the per-token penalty −kl_coef·KL(π‖π_ref) added to the rewards;
   the value target (``value_target``: GAE, V-trace or BRACE) → advantages and critic targets;
   advantages whitened over the batch's actions;
3. ``ppo_epochs`` passes over ``num_minibatches`` shuffled minibatches; each minibatch is one
   optimizer step of the critic and (after ``critic_warmup_steps``) of the actor, accumulated over
   micro-batches. Every token loss (with ``kl_mode="loss"`` the actor's includes kl_coef·KL) is
   summed and divided by the minibatch's global count of action tokens, so accumulation and data
   parallelism give the gradient of one big batch;
4. the new actor weights are published to the data module (a new policy version).

Data parallelism: with ``strategy: ddp`` or Lightning's ``ModelParallelStrategy`` (FSDP2, applied by
:meth:`BraceModule.configure_model` through ``models/parallelize.py``) every rank trains on its own
rollouts; token losses are divided by the global token count and logged metrics are combined over
ranks (:func:`combine_rank_metrics`), so the update is the one of the concatenated batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from jsonargparse import lazy_instance
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from brace_lightning.checks import require_bool, require_int
from brace_lightning.console import quiet_lightning
from brace_lightning.data.base import PublishTarget
from brace_lightning.data.resume import RECORD_KEY, check_same_data_module, data_module_name
from brace_lightning.hparams import from_config, log_final_hparams, to_config
from brace_lightning.metrics import HorizonBeta, ValueBiasGap
from brace_lightning.metrics.functional import reward_to_go
from brace_lightning.models.critic import ValueModel
from brace_lightning.models.handoff import ActorHandoff
from brace_lightning.models.health import require_finite_logprobs
from brace_lightning.models.meta_init import (
    WRAPPER_PREFIX,
    empty_models,
    materialise_and_fill,
    recompute_nonpersistent_buffers,
)
from brace_lightning.models.microbatch import (
    MicroBatch,
    equalize,
    plan_micro_batches,
    score_rows,
    widen,
)
from brace_lightning.models.packing import (
    packed_token_logprobs,
    packed_values,
    prepare_packing,
)
from brace_lightning.models.parallelize import (
    checkpoint_activations,
    mixed_precision_dtypes,
    parallelize,
)
from brace_lightning.models.policy import token_logprobs
from brace_lightning.models.sources import TINY, load_actor, load_tokenizer
from brace_lightning.models.weight_sync import (
    DEFAULT_BUCKET_MB,
    bucket_bytes_from_mb,
    drain,
)
from brace_lightning.objectives import ActorObjective, CriticLoss, PPOClip
from brace_lightning.objectives.functional import KL_ESTIMATORS, kl_to_reference
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.seeds import run_seed
from brace_lightning.step_metrics import (
    DUPLICATE_INFO,
    log_sample_completions,
    log_step_metrics,
    memory_statistics,
    optimizer_statistics,
    rollout_statistics,
)
from brace_lightning.targets import BRACE, ValueTarget

MIN_LOG_RATIO = -20.0
MAX_LOG_RATIO = 20.0

#: Below this return variance the critic's explained variance is logged as NaN.
EXPLAINED_VARIANCE_MIN_VAR = 1e-6

#: Where the KL to the reference policy goes: a term of the actor loss or a reward penalty.
KL_MODES = ("loss", "reward")

#: State-dict prefix of the frozen reference policy (present only with ``kl_coef`` > 0).
REFERENCE_PREFIX = "reference_actor."


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (0 for an empty mask)."""
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x − mean) / std`` over the actions of the batch, 0 at non-actions."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return torch.where(mask, (x - mean) * torch.rsqrt(var + eps), 0.0)


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
        actor_scheduler: optional LR scheduler of the actor's optimizer (stepped every optimizer step).
        critic_scheduler: optional LR scheduler of the critic's optimizer.
        critic_from_actor: initialise the critic's backbone from the actor's (else random).
        ppo_epochs: passes over each rollout batch.
        num_minibatches: optimizer steps per pass (the batch's rows are split evenly).
        micro_batch_size: rows per forward/backward inside a minibatch (None = the whole minibatch).
        max_tokens_per_micro_batch: padded tokens (rows × width) per forward/backward, or real
            tokens with ``pack_sequences``; rows are sorted by length and grouped under both limits
            (``models/microbatch.py``). Also used for the scoring forwards (old log-probs, values)
            at the start of a step. None = no budget.
        pack_sequences: run every actor and critic forward of a step (scoring, EWMA and reference
            actors, the PPO update) on packed rows: the real tokens of a micro-batch as one row,
            no padding (``models/packing.py``); losses and gradients are those of padded rows.
            On by default. An SDPA model is switched to ``VARLEN_SDPA`` (SDPA row by row of a
            packed row, no ``N × N`` mask); flash-attention models use their varlen kernels. A
            model that cannot pack (``packing_problem``) makes the trainer log one sentence and
            keep padded rows.
        critic_warmup_steps: rollout steps during which only the critic is trained.
        max_grad_norm: gradient-norm clip applied to actor and critic separately (None = off).
        whiten_advantages: normalise advantages to zero mean and unit variance over the batch.
        tiny_hidden_size: width of the ``"tiny-char"`` model (multiple of 32).
        tiny_num_layers: depth of the ``"tiny-char"`` model.
        seed: seed of the tiny model's initialisation and of the minibatch shuffling (None: the
            run's ``seed_everything``, see ``brace_lightning.seeds``).
        activation_checkpointing: recompute each transformer block's activations of the actor
            and the critic in the backward pass (less memory, one more forward): blocks wrapped
            before sharding under ``ModelParallelStrategy`` (FSDP2), transformers' gradient
            checkpointing otherwise (single device, DDP).
        fsdp_mixed_precision: under FSDP2, ``"auto"`` (bf16 parameters, fp32 gradient reduction on
            GPU; fp32 on CPU), ``"bf16"`` or ``"fp32"``. The value head, the log-probs and the
            values stay fp32 (``docs/fsdp.md``).
        fsdp_cpu_offload: under FSDP2, keep parameter shards, gradients and optimizer states in
            host memory (``CPUOffloadPolicy``; slower steps, see ``docs/fsdp.md``).
        fsdp_meta_init: under FSDP2, keep actor and critic on the meta device until
            ``configure_model`` shards them, then each rank allocates and reads only its shards
            (``docs/fsdp.md``).
        weight_sync_bucket_mb: under FSDP2, the actor's weights are gathered for the rollout
            engines in buckets of at most this many MiB (a larger tensor is a bucket alone), each
            handed to the data module's ``publish`` (the engine or a weight slot) and
            dropped before the next, so a rank holds at most about two buckets beyond its shards
            and its engine; None gathers the whole state dict on every rank first (the old path,
            one extra full copy per rank). Same values either way (``docs/fsdp.md``).
        kl_coef: weight of the KL to a frozen reference policy π_ref, the actor as it is when RL
            training starts (after any ``SupervisedWarmStart``). 0 (default): no reference model
            is built and nothing changes. Must be >= 0.
        kl_estimator: the per-token estimator of KL(π‖π_ref) on the sampled tokens, ℓ = log π −
            log π_ref: ``"k1"`` (ℓ), ``"k2"`` (½ℓ²) or ``"k3"`` (default; r − 1 − log r with
            r = π_ref/π: unbiased and non-negative), see
            :func:`brace_lightning.objectives.functional.kl_to_reference`.
        kl_mode: ``"loss"`` (default; GRPO, verl ``use_kl_loss``): kl_coef · KL of the current
            actor is added to the actor's token loss, normalised like it, gradient through π only;
            ``"reward"`` (OpenRLHF, TRL PPO): −kl_coef · KL of the actor at the start of the step
            is added to the token rewards before the value target, no gradient (``k1`` is the
            usual estimator there).
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
        for name, value, low in (
            ("ppo_epochs", ppo_epochs, 1),
            ("num_minibatches", num_minibatches, 1),
            ("critic_warmup_steps", critic_warmup_steps, 0),
        ):
            require_int(name, value, low)
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("max_tokens_per_micro_batch", max_tokens_per_micro_batch),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1; got {value!r}.")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be None or > 0; got {max_grad_norm!r}.")
        require_bool("pack_sequences", pack_sequences)
        if isinstance(kl_coef, bool) or not (
            isinstance(kl_coef, int | float) and 0.0 <= kl_coef < math.inf
        ):
            raise ValueError(f"kl_coef must be a finite number >= 0; got {kl_coef!r}.")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {kl_estimator!r}."
            )
        if kl_mode not in KL_MODES:
            raise ValueError(f"kl_mode must be one of {', '.join(KL_MODES)}; got {kl_mode!r}.")
        # load_from_checkpoint passes the saved class_path configs (brace_lightning/hparams.py).
        value_target = from_config(value_target, ValueTarget, "value_target")
        actor_objective = from_config(actor_objective, ActorObjective, "actor_objective")
        critic_loss = from_config(critic_loss, CriticLoss, "critic_loss")
        self.save_hyperparameters()
        self.seed = seed = run_seed(seed)  # hparams keep None: the seed follows seed_everything
        objects = {
            name: to_config(self.hparams[name])
            for name in ("value_target", "actor_objective", "critic_loss")
            if not isinstance(self.hparams[name], dict)  # built in Python, not by LightningCLI
        }
        if objects:
            self.save_hyperparameters(objects)  # saved as the configs LightningCLI writes
        self.automatic_optimization = False
        self.value_target = value_target
        self.actor_objective = actor_objective
        self.critic_loss = critic_loss
        self._actor_optimizer = actor_optimizer
        self._critic_optimizer = critic_optimizer
        self._actor_scheduler = actor_scheduler
        self._critic_scheduler = critic_scheduler
        self.ppo_epochs = ppo_epochs
        self.num_minibatches = num_minibatches
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.pack_sequences = pack_sequences
        self._packs: bool | None = None  # decided at the first step (_packed)
        self.critic_warmup_steps = critic_warmup_steps
        self.max_grad_norm = max_grad_norm
        self.whiten_advantages = whiten_advantages
        self.activation_checkpointing = activation_checkpointing
        bucket_bytes_from_mb(weight_sync_bucket_mb)  # validates the setting
        mixed_precision_dtypes(fsdp_mixed_precision, "cpu")  # validates the setting
        self.fsdp_mixed_precision = fsdp_mixed_precision
        self.fsdp_cpu_offload = fsdp_cpu_offload
        self.weight_sync_bucket_mb = weight_sync_bucket_mb
        self.kl_coef = float(kl_coef)
        self.kl_estimator = kl_estimator
        self.kl_mode = kl_mode

        self.tokenizer = load_tokenizer(actor)
        # fsdp_meta_init: what configure_model fills the meta-built models from.
        self._meta_folder: str | None = None
        self._meta_states: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self._meta_seed = seed + 1
        if fsdp_meta_init and actor_objective.ewma_decay is not None:
            raise ValueError(
                "actor_objective.ewma_decay is not supported with fsdp_meta_init=True (the EWMA "
                "actor is a full copy of the actor); set one of them off."
            )
        if fsdp_meta_init and actor != TINY:  # a checkpoint folder: nothing is read here
            self._meta_folder = actor
            self.actor, self.critic = empty_models(AutoConfig.from_pretrained(actor))
        else:
            self.actor = load_actor(
                actor,
                tokenizer=self.tokenizer,
                hidden_size=tiny_hidden_size,
                num_layers=tiny_num_layers,
                seed=seed,
            )
            self.critic = ValueModel.from_actor(
                self.actor, copy_weights=critic_from_actor, seed=seed + 1
            )
            if fsdp_meta_init:  # random: the usual construction's exact values, sliced later
                self._meta_states = (self.actor.state_dict(), self.critic.state_dict())
                self.actor, self.critic = empty_models(self.actor.config)
        self.actor.train()  # loaders return eval mode; Lightning expects training mode at fit start
        self.critic.train()
        self.ewma_actor: nn.Module | None = None
        if actor_objective.ewma_decay is not None:
            # Hilton et al. 2021: π_prox from a bias-corrected EWMA of the actor's weights.
            self.ewma_actor = copy.deepcopy(self.actor).requires_grad_(False)
            self.register_buffer("ewma_steps", torch.zeros((), dtype=torch.long))
            self._ewma_sums = nn.ParameterList(
                nn.Parameter(torch.zeros_like(p), requires_grad=False)
                for p in self.actor.parameters()
            )
        # The frozen reference policy of the KL term: only with kl_coef > 0. Its weights are the
        # actor's as of the first training step (after any warm start; _capture_reference), then
        # they never change: never in an optimizer, saved in checkpoints (a resumed run keeps the
        # run's initial policy, not the resumed actor). Built here so that Lightning moves it,
        # FSDP2 shards it (configure_model) and checkpoints restore it like the actor.
        self.reference_actor: nn.Module | None = None
        self._reference_captured = False
        if self.kl_coef > 0:
            self.reference_actor = copy.deepcopy(self.actor).requires_grad_(False).eval()
        # β needs no ground truth, so every run logs it (paper Fig. 2b); reset every rollout step.
        self.horizon_beta = HorizonBeta()
        # ĝ_π against Monte-Carlo returns of fresh on-policy rollouts (the validation batches).
        self.val_value_gap = ValueBiasGap()
        self.policy_version = 0
        self.rollout_step = 0
        self._shuffle = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------------ parallelism

    def configure_model(self) -> None:
        """Shard actor, critic (and the reference policy, if any) with FSDP2 under
        ``ModelParallelStrategy``; otherwise only turn on ``activation_checkpointing`` if asked.

        Idempotent: Lightning may call it more than once and a sharded model is left as it is.
        """
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
            return
        if self.ewma_actor is not None:
            raise ValueError(
                "actor_objective.ewma_decay is not supported with ModelParallelStrategy (FSDP2): "
                "the EWMA actor is a full copy of the actor; use strategy 'ddp' or ewma_decay=None."
            )
        param_dtype, reduce_dtype = mixed_precision_dtypes(
            self.fsdp_mixed_precision, self.device_mesh.device_type
        )
        for model in (self.actor, self.critic):
            parallelize(
                model,
                self.device_mesh,
                activation_checkpointing=self.activation_checkpointing,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                cpu_offload=self.fsdp_cpu_offload,
            )
        if self.reference_actor is not None:
            # Sharded like the actor (same mesh, placements and mixed precision), so that
            # _capture_reference copies shard to shard; no activation checkpointing (no backward).
            parallelize(
                self.reference_actor,
                self.device_mesh,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                cpu_offload=self.fsdp_cpu_offload,
            )
        if any(p.is_meta for p in self.actor.parameters()):
            materialise_and_fill(
                self.actor,
                self.critic,
                trainer.strategy.root_device,
                folder=self._meta_folder,
                states=self._meta_states,
                seed=self._meta_seed,
            )
            self._meta_states = None
        if self.reference_actor is not None and any(
            p.is_meta for p in self.reference_actor.parameters()
        ):
            # Allocated only: its values come from the actor (first step) or the checkpoint.
            device = trainer.strategy.root_device
            self.reference_actor.to_empty(device=device)
            recompute_nonpersistent_buffers(self.reference_actor, device)

    def train(self, mode: bool = True) -> BraceModule:
        """Set training mode as ``nn.Module.train`` does, except that the frozen reference policy
        stays in eval mode (no dropout in its log-probs)."""
        super().train(mode)
        reference = getattr(self, "reference_actor", None)  # None before __init__ sets it
        if reference is not None:
            reference.eval()
        return self

    # ------------------------------------------------------------------ optimizers

    def configure_optimizers(self) -> Any:
        actor_opt = (self._actor_optimizer or _adamw(1e-6))(self.actor.parameters())
        critic_opt = (self._critic_optimizer or _adamw(1e-5))(self.critic.parameters())
        schedulers = []
        for opt, factory in (
            (actor_opt, self._actor_scheduler),
            (critic_opt, self._critic_scheduler),
        ):
            if factory is not None:
                schedulers.append({"scheduler": factory(opt), "interval": "step"})
        return [actor_opt, critic_opt], schedulers

    # ------------------------------------------------------------------ the step

    def training_step(self, dataloader_iter: Iterator) -> None:
        batch, _, _ = next(dataloader_iter)
        batch = batch.to(self.device)
        if len(batch) == 0 or batch.num_actions == 0:
            raise RuntimeError(
                f"rollout step {self.rollout_step}: the rollout batch has no action tokens "
                f"(counts: {_counts(batch)}); check the task, the reward function and max_staleness."
            )
        temperature = float(batch.info.get("temperature", 1.0))
        if self.reference_actor is not None and not self._reference_captured:
            self._capture_reference()
        phase_start = time.perf_counter()
        with torch.no_grad():
            plan = self._micro_batches(batch.attention_mask)
            proximal_logprobs = self._score(self.actor, batch, plan, temperature)
            require_finite_logprobs(proximal_logprobs, batch.mask, rollout_step=self.rollout_step)
            old_values = shift_values(
                score_rows(self._values, batch.input_ids, batch.attention_mask, plan)
            )
            forward_seconds = time.perf_counter() - phase_start
            ewma_logprobs = None
            ewma_seconds = 0.0
            # Before the first actor step the average holds no weights (its copy still has the
            # ones from before any warm start), so π_prox is the actor itself until then.
            if self.ewma_actor is not None and int(self.ewma_steps) > 0:
                start = time.perf_counter()
                ewma_logprobs = self._score(self.ewma_actor, batch, plan, temperature)
                ewma_seconds = time.perf_counter() - start
            reference_logprobs = None
            kl_metrics: dict[str, float] = {}
            if self.reference_actor is not None:
                start = time.perf_counter()
                reference_logprobs = self._score_reference(batch, plan, temperature)
                kl_metrics["time/reference_forward_ms"] = (time.perf_counter() - start) * 1e3
                kl = kl_to_reference(
                    proximal_logprobs, reference_logprobs, batch.mask, estimator=self.kl_estimator
                )
                kl_metrics["kl/ref"] = float(masked_mean(kl, batch.mask))
                if self.kl_mode == "reward":
                    # KL is 0 at non-actions, so only the action tokens' rewards change.
                    penalty = -self.kl_coef * kl
                    batch = dataclasses.replace(batch, rewards=batch.rewards + penalty)
                    kl_metrics["kl/ref_penalty"] = float(penalty.sum(1).mean())
                    reference_logprobs = None  # the actor loss has no KL term
            start = time.perf_counter()
            with self._blame(self.value_target):
                targets = self.value_target(
                    rewards=batch.rewards,
                    values=old_values,
                    target_logprobs=proximal_logprobs,
                    behavior_logprobs=batch.behavior_logprobs,
                    mask=batch.mask,
                )
            target_seconds = time.perf_counter() - start
            advantages = targets.advantages
            if self.whiten_advantages:
                advantages = self._whiten(advantages, batch.mask)

        train_actor = self.rollout_step >= self.critic_warmup_steps
        stats: dict[str, list[torch.Tensor]] = {}
        if self.ewma_actor is not None:
            stats["time/ewma_forward_ms"] = [torch.tensor(ewma_seconds * 1e3)]
        phase_start = time.perf_counter()
        for _ in range(self.ppo_epochs):
            order = torch.randperm(len(batch), generator=self._shuffle).to(self.device)
            for rows in order.tensor_split(self.num_minibatches):
                if len(rows):
                    self._update(
                        batch.select(rows),
                        proximal_logprobs[rows],
                        old_values[rows],
                        targets.returns[rows],
                        advantages[rows],
                        None if ewma_logprobs is None else ewma_logprobs[rows],
                        None if reference_logprobs is None else reference_logprobs[rows],
                        train_actor,
                        stats,
                    )
        update_seconds = time.perf_counter() - phase_start
        self.rollout_step += 1
        phase_start = time.perf_counter()
        if train_actor:
            self.policy_version += 1
            self._publish()
        stats["time/old_forward_ms"] = [torch.tensor(forward_seconds * 1e3)]
        stats["time/update_ms"] = [torch.tensor(update_seconds * 1e3)]
        stats["time/weight_sync_ms"] = [torch.tensor((time.perf_counter() - phase_start) * 1e3)]
        tokens = batch.attention_mask.sum() * self.ppo_epochs
        stats["perf/update_tokens_per_s"] = [tokens / max(update_seconds, 1e-9)]
        extra = {
            **rollout_statistics(batch, advantages),
            **optimizer_statistics(self),
            **memory_statistics(self.device),
            **kl_metrics,
        }
        self._log_step(
            batch, proximal_logprobs, old_values, targets.returns, stats, target_seconds, extra
        )
        log_sample_completions(self, batch, self.tokenizer, self.rollout_step)

    def validation_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        """Score on-policy rollouts (``val/reward`` = mean@samples_per_prompt, ``val/accuracy``)
        and the critic's value-bias gap to their realized returns (``val/value_gap_mc``)."""
        batch = batch.to(self.device)
        values = shift_values(self.critic(batch.input_ids, batch.attention_mask))
        realized = reward_to_go(batch.rewards, batch.mask, gamma=self.value_target.gamma)
        self.val_value_gap.update(values, realized, batch.mask)
        size = len(batch)
        # The logged "step" sets the logger's x-axis: the rollout step, as in training.
        log = {"batch_size": size}
        self.log("step", float(self.rollout_step), reduce_fx="max", **log)
        self.log("val/reward", batch.scores.float().mean(), prog_bar=True, **log)
        self.log("val/response_length", batch.mask.sum(1).float().mean(), **log)
        if batch.correct is not None:
            self.log("val/accuracy", batch.correct.float().mean(), **log)
        self.log("val/value_gap_mc", self.val_value_gap, **log)

    def _update(
        self,
        mb: RolloutBatch,
        proximal_logprobs: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        advantages: torch.Tensor,
        ewma_logprobs: torch.Tensor | None,
        reference_logprobs: torch.Tensor | None,
        train_actor: bool,
        stats: dict[str, list[torch.Tensor]],
    ) -> None:
        """One optimizer step of critic (and actor) on minibatch ``mb``, over micro-batches.

        ``reference_logprobs`` (log π_ref, only with ``kl_mode="loss"``) adds kl_coef · KL(π‖π_ref)
        to the actor's token loss, summed and divided by the same global action-token count.
        """
        actor_opt, critic_opt = self.optimizers()
        tokens = self._global_count(mb.mask)
        scale = self.trainer.world_size / tokens  # DDP averages gradients over ranks
        temperature = float(mb.info.get("temperature", 1.0))
        width = mb.input_ids.shape[1]
        sums: dict[str, torch.Tensor] = {}
        for micro in self._micro_batches(mb.attention_mask):
            rows, cols = micro.rows, micro.columns
            ids, attn, mask = mb.input_ids[rows, cols], mb.attention_mask[rows, cols], mb.mask[rows]
            values = shift_values(widen(self._values(ids, attn), cols, width))
            with self._blame(self.critic_loss):
                critic_out = self.critic_loss(
                    values=values, old_values=old_values[rows], returns=returns[rows], mask=mask
                )
            # A filler (weight 0) only keeps the ranks' backward counts equal.
            critic_loss = critic_out.token_loss.sum() * scale * micro.weight
            self._check_finite("critic loss", critic_loss)
            self.manual_backward(critic_loss)
            if micro.weight:
                _add(sums, "critic/loss", critic_loss.detach() / self.trainer.world_size)
                _add_stats(sums, "critic", critic_out.stats, tokens)
            if not train_actor:
                continue
            logprobs = widen(self._logprobs(self.actor, ids, attn, temperature), cols, width)
            prox = proximal_logprobs[rows] if ewma_logprobs is None else ewma_logprobs[rows]
            with self._blame(self.actor_objective):
                actor_out = self.actor_objective(
                    logprobs=logprobs,
                    proximal_logprobs=prox,
                    behavior_logprobs=mb.behavior_logprobs[rows],
                    advantages=advantages[rows],
                    mask=mask,
                    entropy=None if mb.entropy is None else mb.entropy[rows],
                )
            token_loss = actor_out.token_loss
            if reference_logprobs is not None:
                kl = kl_to_reference(
                    logprobs, reference_logprobs[rows], mask, estimator=self.kl_estimator
                )
                kl_loss = self.kl_coef * kl
                token_loss = token_loss + kl_loss
                if micro.weight:
                    kl_part = kl_loss.detach().sum() * scale / self.trainer.world_size
                    _add(sums, "actor/kl_ref_loss", kl_part)
            actor_loss = token_loss.sum() * scale * micro.weight
            self._check_finite("actor loss", actor_loss)
            self.manual_backward(actor_loss)
            if micro.weight:
                _add(sums, "actor/loss", actor_loss.detach() / self.trainer.world_size)
                _add_stats(sums, "actor", actor_out.stats, tokens)
        if self.trainer.world_size > 1:
            sums = self._reduce_over_ranks(sums)
        for name, value in sums.items():
            stats.setdefault(name, []).append(value)

        critic_norm = self._clip(self.critic)
        critic_opt.step()
        critic_opt.zero_grad(set_to_none=True)
        stats.setdefault("critic/grad_norm", []).append(critic_norm)
        if train_actor:
            actor_norm = self._clip(self.actor)
            actor_opt.step()
            actor_opt.zero_grad(set_to_none=True)
            stats.setdefault("actor/grad_norm", []).append(actor_norm)
            self._update_ewma()
        for scheduler, trained in zip(self._schedulers(), (train_actor, True), strict=True):
            if scheduler is not None and trained:
                scheduler.step()

    # ------------------------------------------------------------------ helpers

    def _schedulers(self) -> tuple[Any, Any]:
        schedulers = self.lr_schedulers()
        if schedulers is None:
            return None, None
        if not isinstance(schedulers, list):
            schedulers = [schedulers]
        by_opt = {id(s.optimizer): s for s in schedulers}
        actor_opt, critic_opt = self.optimizers()
        return by_opt.get(id(actor_opt.optimizer)), by_opt.get(id(critic_opt.optimizer))

    def _whiten(self, x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        """:func:`whiten` with mean and variance over the actions of all data-parallel ranks."""
        if self.trainer.world_size == 1:
            return whiten(x, mask, eps)
        count = self._global_count(mask)
        strategy = self.trainer.strategy
        mean = strategy.reduce(torch.where(mask, x, 0.0).sum(), reduce_op="sum") / count
        centered = torch.where(mask, x - mean, 0.0)
        var = strategy.reduce((centered**2).sum(), reduce_op="sum") / count
        return centered * torch.rsqrt(var + eps)

    def _micro_batches(self, attention_mask: torch.Tensor) -> list[MicroBatch]:
        """This rank's micro-batches of a minibatch, as many as on the rank with the most."""
        plan = plan_micro_batches(
            attention_mask,
            max_rows=self.micro_batch_size,
            max_tokens=self.max_tokens_per_micro_batch,
            packed=self._packed(),
        )
        if self.trainer.world_size > 1:
            count = torch.tensor(float(len(plan)), device=attention_mask.device)
            count = self.trainer.strategy.reduce(count, reduce_op="max")
            plan = equalize(plan, int(count), attention_mask)
        return plan

    def _score(
        self, actor: nn.Module, batch: RolloutBatch, plan: list[MicroBatch], temperature: float
    ) -> torch.Tensor:
        """``[B, T]`` log-probs of ``batch`` under ``actor``, micro-batch by micro-batch."""

        def logprobs(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
            return self._logprobs(actor, ids, attn, temperature)

        return score_rows(logprobs, batch.input_ids, batch.attention_mask, plan)

    def _packed(self) -> bool:
        """Whether this run's forwards use packed rows: ``pack_sequences`` and both the actor and
        the critic can pack (``prepare_packing``, checked at the first call, which also moves SDPA
        models to row-by-row attention; the EWMA and reference actors are copies of the actor and
        attend like it). If one cannot, one sentence is logged and every forward keeps padded
        rows, so the token budget always counts what is computed."""
        if self._packs is None:
            self._packs = self.pack_sequences
            for model in (self.actor, self.critic) if self.pack_sequences else ():
                problem = prepare_packing(model)
                if problem is not None:
                    rank_zero_warn(
                        f"pack_sequences=True: the {type(model).__name__} cannot run on packed "
                        f"rows ({problem}); every forward uses padded rows."
                    )
                    self._packs = False
                    break
            for copy_ in (self.ewma_actor, self.reference_actor):  # attend like the actor
                if copy_ is not None:
                    copy_.config._attn_implementation = self.actor.config._attn_implementation
        return self._packs

    def _logprobs(
        self, actor: nn.Module, ids: torch.Tensor, attn: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """``[n, w]`` log-probs of one micro-batch under ``actor``, packed or padded."""
        logprobs = packed_token_logprobs if self._packed() else token_logprobs
        return logprobs(actor, ids, attn, temperature=temperature)[0]

    def _values(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """``[n, w]`` critic values of one micro-batch, packed or padded."""
        return packed_values(self.critic, ids, attn) if self._packed() else self.critic(ids, attn)

    @torch.no_grad()
    def _capture_reference(self) -> None:
        """Copy the actor's weights into the reference policy, once per run.

        Called at the start of the first training step of a run whose reference is not captured
        yet (a fresh run; a resumed one restores the captured reference from its checkpoint): the
        actor as RL training starts, after setup-time warm starts. It runs before any forward of
        the step, so under FSDP2 both models hold only their shards, placed alike, and the copy is
        shard to shard. Afterwards the reference changes only through checkpoint loading.
        """
        assert self.reference_actor is not None  # only called with kl_coef > 0
        sources = {
            name.replace(WRAPPER_PREFIX, ""): tensor
            for named in (self.actor.named_parameters(), self.actor.named_buffers())
            for name, tensor in named
        }
        for named in (
            self.reference_actor.named_parameters(),
            self.reference_actor.named_buffers(),
        ):
            for name, tensor in named:
                tensor.copy_(sources[name])
        self._reference_captured = True

    def _score_reference(
        self, batch: RolloutBatch, plan: list[MicroBatch], temperature: float
    ) -> torch.Tensor:
        """``[B, T]`` log π_ref of ``batch`` under the frozen reference policy (call without
        grad), micro-batch by micro-batch like the actor's proximal log-probs."""
        reference = self.reference_actor
        assert reference is not None  # only called with kl_coef > 0
        logprobs = self._score(reference, batch, plan, temperature)
        if isinstance(reference, FSDPModule):
            # No backward ever runs through it: free the root's gathered parameters now.
            reference.reshard()
        return logprobs

    def _global_count(self, mask: torch.Tensor) -> torch.Tensor:
        """Action tokens of this minibatch summed over all data-parallel ranks (at least 1)."""
        count = mask.sum().to(torch.float32)
        if self.trainer.world_size > 1:
            count = self.trainer.strategy.reduce(count, reduce_op="sum")
        return count.clamp(min=1.0)

    def _reduce_over_ranks(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-minibatch stats of all ranks: ``*_max`` → maximum, the rest → sum (they are this
        rank's share of a loss or count already divided by the global token count)."""
        names = sorted(sums)
        values = torch.stack([sums[name].float().reshape(()) for name in names])
        is_max = torch.tensor([name.endswith("_max") for name in names], device=values.device)
        strategy = self.trainer.strategy
        total = strategy.reduce(torch.where(is_max, 0.0, values), reduce_op="sum")
        peak = strategy.reduce(torch.where(is_max, values, -math.inf), reduce_op="max")
        combined = torch.where(is_max, peak, total)
        return dict(zip(names, combined.unbind(), strict=True))

    def _clip(self, model: nn.Module) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        max_norm = math.inf if self.max_grad_norm is None else self.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm).detach()
        # FSDP2: the norm of DTensor gradients is a replicated DTensor (the global norm).
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    @contextlib.contextmanager
    def _blame(self, component: object) -> Iterator[None]:
        """Prefix a ValueError raised by ``component`` with the rollout step and the component."""
        try:
            yield
        except ValueError as error:
            raise ValueError(f"rollout step {self.rollout_step}, {component!r}: {error}") from error

    def _check_finite(self, what: str, value: torch.Tensor) -> None:
        if not bool(torch.isfinite(value)):
            raise FloatingPointError(
                f"rollout step {self.rollout_step}: the {what} is {float(value)}; expected a finite "
                "value (check learning rates, log-prob clamping and the rewards)."
            )

    @torch.no_grad()
    def _update_ewma(self) -> None:
        if self.ewma_actor is None:
            return
        decay = float(self.actor_objective.ewma_decay)  # type: ignore[arg-type]
        self.ewma_steps += 1
        correction = 1.0 - decay ** int(self.ewma_steps)
        for total, param, ewma in zip(
            self._ewma_sums, self.actor.parameters(), self.ewma_actor.parameters(), strict=True
        ):
            total.mul_(decay).add_(param.detach(), alpha=1.0 - decay)
            ewma.copy_(total / correction)

    def setup(self, stage: str) -> None:
        """Build the actor's weight hand-off (the only way weights leave the trainer) and hand it
        to the Trainer's rollout data module (``models/handoff.py``)."""
        bucket_bytes = bucket_bytes_from_mb(self.weight_sync_bucket_mb)
        self.handoff = ActorHandoff(self.actor, bucket_bytes=bucket_bytes)
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

    def _log_step(
        self,
        batch: RolloutBatch,
        proximal_logprobs: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        stats: dict[str, list[torch.Tensor]],
        target_seconds: float,
        extra: dict[str, float],
    ) -> None:
        mask = batch.mask
        log_w = (proximal_logprobs - batch.behavior_logprobs).clamp(MIN_LOG_RATIO, MAX_LOG_RATIO)
        w = log_w.exp()
        residual_var = masked_mean(
            (returns - old_values - masked_mean(returns - old_values, mask)) ** 2, mask
        )
        return_var = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
        metrics: dict[str, float | torch.Tensor] = {
            "rollout/reward": batch.scores.float().mean(),
            "rollout/response_length": mask.sum(1).float().mean(),
            # Undefined (NaN, as in Stable-Baselines3) when the targets have no spread: a floor on
            # the denominator would log values like -1e6 for batches whose rewards are all equal.
            "critic/explained_variance": 1.0 - residual_var / return_var
            if float(return_var) > EXPLAINED_VARIANCE_MIN_VAR
            else math.nan,
            "critic/value_mean": masked_mean(old_values, mask),
            "critic/target_mean": masked_mean(returns, mask),
            "weights/log_w_mean": masked_mean(log_w, mask),
            "weights/w_mean": masked_mean(w, mask),
            "weights/w_max": torch.where(mask, w, 0.0).max(),
            "kl/mu_pi_k3": masked_mean(w - 1.0 - log_w, mask),
            "kl/pi_mu": masked_mean(w * log_w, mask),
            "mismatch/abs_logprob_diff": masked_mean(log_w.abs(), mask),
            "time/value_target_ms": target_seconds * 1e3,
            "policy_version": float(self.policy_version),
        }
        if batch.correct is not None:
            metrics["rollout/accuracy"] = batch.correct.float().mean()
        metrics.update(self._beta_metrics(batch, returns))
        metrics.update(extra)
        for name, values in stats.items():
            per_update = torch.stack([v.float().reshape(()) for v in values])
            if name.endswith("_max"):
                metrics[name] = per_update.max()
            elif name.endswith("_tokens"):  # tokens per pass over the rollout batch
                metrics[name] = per_update.sum() / self.ppo_epochs
            else:
                metrics[name] = per_update.mean()
        for name, value in batch.info.items():
            if isinstance(value, int | float) and name not in ("temperature", *DUPLICATE_INFO):
                metrics[f"data/{name}"] = float(value)
        # x-axis = rollout step (one rollout batch), not Lightning's global_step, which counts
        # every optimizer step of both optimizers and so moves unevenly across critic warm-up.
        values = {name: float(value) for name, value in metrics.items()}
        if self.trainer.world_size > 1:
            per_rank: list[Any] = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(per_rank, values)
            values = combine_rank_metrics(per_rank)
        log_step_metrics(self, values, self.rollout_step, len(batch))

    def _beta_metrics(self, batch: RolloutBatch, returns: torch.Tensor) -> dict[str, float]:
        """β of this step's critic targets on the realized return, per remaining-horizon bin
        (``critic/beta_by_horizon/h<edge>``), and ``critic/beta``: the longest defined bin's β."""
        realized = reward_to_go(batch.rewards, batch.mask, gamma=self.value_target.gamma)
        self.horizon_beta.reset()
        self.horizon_beta.update(returns, realized, batch.mask)
        beta = self.horizon_beta.compute()
        out: dict[str, float] = {}
        for edge, value, defined in zip(
            beta.edges.tolist(), beta.value.tolist(), beta.defined.tolist(), strict=True
        ):
            if defined:
                out[f"critic/beta_by_horizon/h{edge:05d}"] = value
                out["critic/beta"] = value  # bins ascend: the last defined one wins
        return out

    # ------------------------------------------------------------------ checkpoints

    def on_fit_end(self) -> None:
        log_final_hparams(self)  # HParams tab: the hyperparameters with the final metrics

    def _attached_datamodule(self) -> pl.LightningDataModule | None:
        """The trainer's data module; None for a module without a trainer (load_from_checkpoint)."""
        return None if self._trainer is None else self._trainer.datamodule

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["brace"] = {
            "policy_version": self.policy_version,
            "rollout_step": self.rollout_step,
            "shuffle": self._shuffle.get_state(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            # as plain types so the checkpoint loads with torch.load(weights_only=True)
            "numpy_rng": _numpy_state_to_plain(np.random.get_state()),
            RECORD_KEY: data_module_name(self._attached_datamodule()),
        }
        if self.reference_actor is not None:
            checkpoint["brace"]["reference_captured"] = self._reference_captured

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["brace"]
        check_same_data_module(checkpoint, state.get(RECORD_KEY), self._attached_datamodule())
        self._load_reference_state(checkpoint)
        self.policy_version = int(state["policy_version"])
        self.rollout_step = int(state["rollout_step"])
        self._shuffle.set_state(state["shuffle"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        name, keys, pos, has_gauss, cached = state["numpy_rng"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))

    def _load_reference_state(self, checkpoint: dict[str, Any]) -> None:
        """Keep the reference policy of the checkpointed run (its weights are in the state dict).

        With ``kl_coef`` > 0 the checkpoint must hold a reference: a run saved without one has
        lost its initial policy, and capturing the resumed actor instead would silently change
        what the KL is measured against. With ``kl_coef`` = 0 a saved reference is dropped, so a
        run can be resumed with the KL term off. Under FSDP2 Lightning loads the sharded state
        dict before this hook, by the module's keys: a saved reference is then simply not read
        with ``kl_coef`` = 0, and a missing one stops the load with torch's "Missing key in
        checkpoint state_dict: state_dict.reference_actor..." instead of this method's sentence.
        """
        state = checkpoint["brace"]
        weights = checkpoint.get("state_dict", {})
        if self.reference_actor is None:
            for key in [key for key in weights if key.startswith(REFERENCE_PREFIX)]:
                del weights[key]
            return
        if "reference_captured" not in state:
            raise ValueError(
                f"kl_coef={self.kl_coef} needs a checkpoint that holds the reference policy; got "
                "one saved with kl_coef=0 (resume it with kl_coef=0, or start a new run)."
            )
        self._reference_captured = bool(state["reference_captured"])


def combine_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One value per metric from every data-parallel rank's: ``*_max`` → maximum, ``*_min`` →
    minimum, ``data/count/*`` (sample counters) → sum, anything else → mean over the ranks that
    logged it (so a ``*_std`` is the mean of the per-rank standard deviations).

    The minibatch statistics (losses, clip fractions, ...) are already summed over ranks in
    ``_update``, so their mean is the value itself; rollout metrics such as ``rollout/reward``
    become the mean of the per-rank means (ranks hold equally many rows).
    """
    names = sorted({name for values in per_rank for name in values})
    out: dict[str, float] = {}
    for name in names:
        values = [ranked[name] for ranked in per_rank if name in ranked]
        if name.endswith("_max"):
            out[name] = max(values)
        elif name.endswith("_min"):
            out[name] = min(values)
        elif name.startswith("data/count/"):
            out[name] = sum(values)
        else:
            out[name] = sum(values) / len(values)
    return out


def _numpy_state_to_plain(state: Any) -> tuple[str, list[int], int, int, float]:
    name, keys, pos, has_gauss, cached = state
    return str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)


def _adamw(lr: float) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr)

    return build


def _add(sums: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    sums[name] = sums[name] + value if name in sums else value


def _add_stats(
    sums: dict[str, torch.Tensor], prefix: str, stats: dict[str, torch.Tensor], tokens: torch.Tensor
) -> None:
    """Fold an objective's micro-batch stats into per-minibatch values: ``*_count`` → fraction of
    the minibatch's action tokens and ``*_tokens`` (the count itself: tokens the rule hit),
    ``*_sum`` → mean per action token, ``*_max`` → maximum."""
    for name, value in stats.items():
        value = value.detach().float()
        if name.endswith("_max"):
            key = f"{prefix}/{name}"
            sums[key] = torch.maximum(sums[key], value) if key in sums else value
        elif name.endswith("_count"):
            rule = name.removesuffix("_count")
            _add(sums, f"{prefix}/{rule}_fraction", value / tokens)
            _add(sums, f"{prefix}/{rule}_tokens", value)
        elif name.endswith("_sum"):
            _add(sums, f"{prefix}/{name.removesuffix('_sum')}_mean", value / tokens)
        else:
            _add(sums, f"{prefix}/{name}", value)


def _counts(batch: RolloutBatch) -> dict[str, float]:
    return {k: v for k, v in batch.info.items() if k.startswith("count/")}
