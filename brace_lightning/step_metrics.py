"""A training step's metrics: what is measured, how minibatch statistics fold, how they reach Lightning.

- :class:`UpdateStats` folds the objectives' per-micro-batch statistics into per-minibatch values and
  those into one value per rollout step; :func:`step_statistics` measures the batch, the critic and
  the behaviour weights (their KL estimates and effective sample size); :func:`beta_metrics` the
  critic targets' β by remaining horizon; :func:`equal_reward_statistics` the equal-reward rules.
- The module combines them into one dict of scalars per rollout step, combined over ranks
  (:func:`brace_lightning.ranks.combine_rank_metrics`), so every rank logs the same values and no
``sync_dist`` is needed. Logging them with ``self.log_dict`` (not ``logger.log_metrics``) puts them
in ``trainer.callback_metrics``, where ``ModelCheckpoint(monitor="rollout/reward")`` and
``EarlyStopping`` find them. A logged ``"step"`` key sets the logger's x-axis (Lightning's
convention): the rollout step, which is also ``trainer.global_step`` (``optim.py``);
``trainer.log_every_n_steps`` applies as usual (the configs set 1).
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from brace_lightning.equal_rewards import equal_reward_group_fraction
from brace_lightning.metrics import HorizonBeta
from brace_lightning.metrics.functional import reward_to_go
from brace_lightning.models.microbatch import MicroBatch
from brace_lightning.objectives.functional import MAX_LOG_RATIO
from brace_lightning.optim import optimizers_by_network
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.scorer import Scored, Scorer

#: ``data/*`` entries of the batch info that repeat a ``rollout/*`` metric under another name
#: (``truncated_fraction`` is logged as ``rollout/length_capped_fraction``).
DUPLICATE_INFO = frozenset({"mean_score", "accuracy", "mean_response_length", "truncated_fraction"})

#: Below this return variance the critic's explained variance is logged as NaN.
EXPLAINED_VARIANCE_MIN_VAR = 1e-6

#: Progress-bar name -> logged metric (shown when the metric was logged this step).
PROGRESS_BAR = {
    "reward": "rollout/reward",
    "kl": "kl/mu_pi_k3",
    "stale": "data/staleness_mean",
    "tok/s": "data/train_tokens_per_s",
}


def log_step_metrics(
    module: pl.LightningModule, values: Mapping[str, float], step: int, batch_size: int
) -> None:
    """Log ``values`` at x-axis ``step`` and a short progress-bar summary (reward, KL(µ‖π), mean
    staleness, tokens/s where known; the bar entries are not sent to the logger)."""
    module.log_dict(
        {**values, "step": float(step)},
        on_step=True,
        on_epoch=False,
        batch_size=batch_size,
    )
    bar = {short: values[name] for short, name in PROGRESS_BAR.items() if name in values}
    module.log_dict(
        bar, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=batch_size
    )


class PhaseTimer:
    """Wall seconds of named phases: ``with timer("update"): ...`` → ``timer.seconds["update"]``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (0 for an empty mask)."""
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


class UpdateStats:
    """Statistics of one rollout step's PPO update.

    Within a minibatch (:meth:`add`, :meth:`add_objective`) values are summed, ``*_max`` maximised;
    :meth:`end_minibatch` closes a minibatch (after the rank reduction); :meth:`fold` gives one value
    per rollout step: ``*_max`` → maximum over minibatches, ``*_tokens`` → tokens per pass over the
    batch, the rest → mean over minibatches.
    """

    def __init__(self) -> None:
        self.minibatch: dict[str, torch.Tensor] = {}
        self.per_update: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        """Add ``value`` to this minibatch's ``name``."""
        sums = self.minibatch
        sums[name] = sums[name] + value if name in sums else value

    def add_objective(
        self, prefix: str, stats: dict[str, torch.Tensor], tokens: torch.Tensor
    ) -> None:
        """Fold an objective's micro-batch stats: ``*_count`` → fraction of the minibatch's action
        tokens and ``*_tokens`` (the count itself: tokens the rule hit), ``*_sum`` → mean per action
        token, ``*_max`` → maximum."""
        for name, value in stats.items():
            value = value.detach().float()
            if name.endswith("_max"):
                key = f"{prefix}/{name}"
                sums = self.minibatch
                sums[key] = torch.maximum(sums[key], value) if key in sums else value
            elif name.endswith("_count"):
                rule = name.removesuffix("_count")
                self.add(f"{prefix}/{rule}_fraction", value / tokens)
                self.add(f"{prefix}/{rule}_tokens", value)
            elif name.endswith("_sum"):
                self.add(f"{prefix}/{name.removesuffix('_sum')}_mean", value / tokens)
            else:
                self.add(f"{prefix}/{name}", value)

    def end_minibatch(self, sums: dict[str, torch.Tensor]) -> None:
        """Keep a finished minibatch's (rank-reduced) ``sums`` and start the next one."""
        for name, value in sums.items():
            self.append(name, value)
        self.minibatch = {}

    def append(self, name: str, value: torch.Tensor | float) -> None:
        """One more per-update value of ``name`` (a gradient norm, a timing)."""
        self.per_update.setdefault(name, []).append(torch.as_tensor(value))

    def fold(self, ppo_epochs: int) -> dict[str, torch.Tensor]:
        """One value per statistic for the rollout step."""
        out = {}
        for name, values in self.per_update.items():
            per_update = torch.stack([v.float().reshape(()) for v in values])
            if name.endswith("_max"):
                out[name] = per_update.max()
            elif name.endswith("_tokens"):  # tokens per pass over the rollout batch
                out[name] = per_update.sum() / ppo_epochs
            else:
                out[name] = per_update.mean()
        return out


def effective_sample_size_fraction(log_weights: torch.Tensor) -> float:
    """ESS/N of importance weights given by their logs ``[N]``: (Σw)² / (N·Σw²), in (0, 1].

    Kish's effective sample size: 1 when every weight is equal (on-policy), 1/N when one weight
    carries all the mass. Computed in float64 from log-sum-exps, so weights as large as e^(20·T) of
    a long sequence neither overflow nor lose the small ones. NaN for N = 0.
    """
    log_weights = log_weights.detach().double().flatten()
    if log_weights.numel() == 0:
        return math.nan
    log_ess = 2.0 * torch.logsumexp(log_weights, 0) - torch.logsumexp(2.0 * log_weights, 0)
    return float(torch.exp(log_ess) / log_weights.numel())


def step_statistics(
    batch: RolloutBatch,
    proximal_logprobs: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
) -> dict[str, float | torch.Tensor]:
    """Reward and length of the batch, the critic's fit to its targets, and the behaviour weights
    w = π_prox/µ of the action tokens (log w clamped to ±MAX_LOG_RATIO, as every ratio).

    - ``kl/mu_pi_k3``: mean of w − 1 − log w, the k3 estimator (Schulman 2020) of KL(µ‖π_prox) per
      token on µ's samples; nonnegative per token, low variance: the headline KL (progress bar).
    - ``kl/pi_mu``: mean of w·log w, the importance-weighted estimator of KL(π_prox‖µ) per token:
      unbiased, but heavy-tailed (a few tokens with w of 10²–10³ dominate it, and it can be
      negative); kept under its old key for comparison with earlier runs.
    - ``weights/ess_fraction_tokens``: ESS/N of the action tokens' w
      (:func:`effective_sample_size_fraction`); ``weights/ess_fraction_sequences``: the same over the
      rows' sequence weights exp(Σ_t log w_t). This rank's tokens and rows (ranks are averaged).
    - ``rollout/length_capped_fraction``: responses cut at the engine's ``max_new_tokens``
      (the batch info's ``truncated_fraction``; absent when the data module does not report it).
    """
    mask = batch.mask
    log_w = (proximal_logprobs - batch.behavior_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
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
        "weights/ess_fraction_tokens": effective_sample_size_fraction(log_w[mask]),
        "weights/ess_fraction_sequences": effective_sample_size_fraction(
            torch.where(mask, log_w, 0.0).sum(1)[mask.any(1)]
        ),
    }
    if "truncated_fraction" in batch.info:
        metrics["rollout/length_capped_fraction"] = float(batch.info["truncated_fraction"])
    if batch.correct is not None:
        metrics["rollout/accuracy"] = batch.correct.float().mean()
    return metrics


def version_drift(
    scorer: Scorer,
    actor: torch.nn.Module,
    batch: RolloutBatch,
    plan: list[MicroBatch],
    proximal_logprobs: torch.Tensor,
) -> dict[str, float]:
    """``kl/version_drift_k3``: the drift between consecutive policy versions v → v + 1.

    The mean over the batch's action tokens of r − 1 − log r, r = π_{v+1}(y_t)/π_v(y_t) (log r
    clamped to ±MAX_LOG_RATIO): the k3 estimator of KL(π_v ‖ π_{v+1}) per token, exact in
    expectation when the tokens are π_v's own samples (lag 0) and a token-averaged drift on stale
    ones. π_v is the step's proximal policy (``proximal_logprobs`` ``[B, T]``, already scored);
    π_{v+1} costs one more no-grad forward of the updated ``actor`` over ``plan``.
    """
    temperature = float(batch.info.get("temperature", 1.0))
    with torch.no_grad():
        updated = scorer.score(actor, batch, plan, temperature)
    log_r = (updated - proximal_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return {"kl/version_drift_k3": float(masked_mean(log_r.exp() - 1.0 - log_r, batch.mask))}


def beta_metrics(
    horizon_beta: HorizonBeta, batch: RolloutBatch, returns: torch.Tensor, gamma: float
) -> dict[str, float]:
    """β of this step's critic targets on the realized return, per remaining-horizon bin
    (``critic/beta_by_horizon/h<edge>``), and ``critic/beta``: the longest defined bin's β."""
    realized = reward_to_go(batch.rewards, batch.mask, gamma=gamma)
    horizon_beta.reset()
    horizon_beta.update(returns, realized, batch.mask)
    beta = horizon_beta.compute()
    out: dict[str, float] = {}
    for edge, value, defined in zip(
        beta.edges.tolist(), beta.value.tolist(), beta.defined.tolist(), strict=True
    ):
        if defined:
            out[f"critic/beta_by_horizon/h{edge:05d}"] = value
            out["critic/beta"] = value  # bins ascend: the last defined one wins
    return out


def equal_reward_statistics(module: Any, batch: RolloutBatch) -> dict[str, float]:
    """The equal-reward rules of ``module`` (a ``BraceModule``; ``equal_rewards.py``) on this step:
    ``actor/skipped_equal_reward`` (1: the batch rule took the actor's step, else 0),
    ``actor/skipped_equal_reward_total`` (the steps past the critic warm-up that published no
    policy version: all skipped by the rule) and ``rollout/equal_reward_group_fraction`` (prompt
    groups of two or more rows whose rewards are all equal; absent when there is none)."""
    due_steps = max(0, module.rollout_step - module.critic_warmup_steps)
    out = {
        "actor/skipped_equal_reward": float(module.equal_rewards.skipped),
        "actor/skipped_equal_reward_total": float(due_steps - module.policy_version),
    }
    fraction = equal_reward_group_fraction(batch.scores, batch.group_ids)
    if not math.isnan(fraction):
        out["rollout/equal_reward_group_fraction"] = fraction
    return out


def info_metrics(batch: RolloutBatch) -> dict[str, float]:
    """The data module's numeric batch info as ``data/*`` (repeats of ``rollout/*`` left out)."""
    return {
        f"data/{name}": float(value)
        for name, value in batch.info.items()
        if isinstance(value, int | float) and name not in ("temperature", *DUPLICATE_INFO)
    }


def log_training_step(
    module: Any,
    batch: RolloutBatch,
    scored: Scored,
    stats: UpdateStats,
    scoring: dict[str, float],
    timer: PhaseTimer,
) -> None:
    """Log one rollout step of ``module`` (a ``BraceModule``): the batch, critic and weights
    statistics, β, the rollout and optimizer statistics, the scoring phase's ``scoring`` metrics,
    the folded update ``stats``, the phases' times (``time/<phase>_ms``, ``perf/update_tokens_per_s``)
    and the data module's info, combined over ranks; every
    :data:`SAMPLES_EVERY_N_STEPS` steps a few completions. The x-axis is the rollout step (the
    logged ``"step"``), which is also Lightning's global_step (``optim.one_global_step``)."""
    for name, seconds in timer.seconds.items():
        stats.append(f"time/{name}_ms", seconds * 1e3)
    tokens = batch.attention_mask.sum() * module.ppo_epochs
    stats.append("perf/update_tokens_per_s", tokens / max(timer.seconds["update"], 1e-9))
    metrics = {
        **step_statistics(batch, scored.proximal, scored.old_values, scored.returns),
        "policy_version": float(module.policy_version),
        **beta_metrics(module.horizon_beta, batch, scored.returns, module.value_target.gamma),
        **rollout_statistics(batch, scored.advantages),
        **equal_reward_statistics(module, batch),
        **optimizer_statistics(module),
        **memory_statistics(module.device),
        **scoring,
        **stats.fold(module.ppo_epochs),
        **info_metrics(batch),
    }
    if module.critic is None:  # a critic-free target: no critic to measure
        metrics = {k: v for k, v in metrics.items() if not k.startswith("critic/")}
    values = module.ranks.combine_metrics({k: float(v) for k, v in metrics.items()})
    log_step_metrics(module, values, module.rollout_step, len(batch))
    log_sample_completions(module, batch, module.tokenizer, module.rollout_step)


#: Every this many rollout steps, a few sample completions go to TensorBoard as text.
SAMPLES_EVERY_N_STEPS = 10
#: Completions per text sample.
NUM_SAMPLES = 4


def _masked_summary(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``name_mean``, ``_std``, ``_min``, ``_max`` of ``values`` where ``mask`` (nothing if empty)."""
    picked = values[mask].double()
    if picked.numel() == 0:
        return {}
    return {
        f"{name}_mean": float(picked.mean()),
        f"{name}_std": float(picked.std(correction=0)),
        f"{name}_min": float(picked.min()),
        f"{name}_max": float(picked.max()),
    }


def rollout_statistics(batch: RolloutBatch, advantages: torch.Tensor) -> dict[str, float]:
    """What PPO-for-LLM users look for, per rollout batch (this rank's rows).

    ``rollout/score_*`` (sequence reward mean/std/min/max; ``rollout/reward`` is its mean),
    ``rollout/advantage_*`` over action tokens, ``rollout/entropy`` (mean entropy of the engine's
    sampling distribution at the actions, when the engine records it), ``rollout/prompt_length``
    (mean prompt tokens: real tokens before the first action) and ``rollout/response_length_max``.
    """
    rows = torch.ones_like(batch.scores, dtype=torch.bool)
    out = _masked_summary("rollout/score", batch.scores.float(), rows)
    out.pop("rollout/score_mean", None)  # = rollout/reward
    out.update(_masked_summary("rollout/advantage", advantages, batch.mask))
    if batch.entropy is not None and bool(batch.mask.any()):
        out["rollout/entropy"] = float(batch.entropy[batch.mask].double().mean())
    before_first_action = batch.mask.long().cumsum(1) == 0
    prompt = (batch.attention_mask.bool() & before_first_action).sum(1).float()
    out["rollout/prompt_length"] = float(prompt.mean())
    out["rollout/response_length_max"] = float(batch.mask.sum(1).max())
    return out


def optimizer_statistics(module: pl.LightningModule) -> dict[str, float]:
    """``lr/actor`` and ``lr/critic``: each optimizer's current learning rate (first group; no
    ``lr/critic`` without a critic)."""
    actor_opt, critic_opt = optimizers_by_network(module)
    out = {"lr/actor": float(actor_opt.param_groups[0]["lr"])}
    if critic_opt is not None:
        out["lr/critic"] = float(critic_opt.param_groups[0]["lr"])
    return out


def memory_statistics(device: torch.device) -> dict[str, float]:
    """``memory/max_rss_gb`` (this process's peak resident set, ``getrusage``) and, on CUDA,
    ``memory/cuda_max_allocated_gb`` (peak since the start, ``torch.cuda.max_memory_allocated``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out = {"memory/max_rss_gb": peak / (2**30 if sys.platform == "darwin" else 2**20)}
    if device.type == "cuda":
        out["memory/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def log_sample_completions(
    module: pl.LightningModule, batch: RolloutBatch, tokenizer: Any, step: int
) -> None:
    """Every :data:`SAMPLES_EVERY_N_STEPS` rollout steps (and at step 1), the first
    :data:`NUM_SAMPLES` rows as TensorBoard text ``samples/completions``: prompt, completion and
    score (global rank 0, TensorBoard loggers only)."""
    if step != 1 and step % SAMPLES_EVERY_N_STEPS:
        return
    if module.trainer.global_rank != 0:
        return
    writers = [lg.experiment for lg in module.loggers if isinstance(lg, TensorBoardLogger)]
    if not writers:
        return
    lines = []
    for row in range(min(NUM_SAMPLES, len(batch))):
        real = batch.attention_mask[row].bool()
        action = batch.mask[row]
        prompt_ids = batch.input_ids[row][real & (action.long().cumsum(0) == 0)]
        completion_ids = batch.input_ids[row][action]
        prompt = tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=True)
        completion = tokenizer.decode(completion_ids.tolist(), skip_special_tokens=True)
        lines.append(
            f"**score {float(batch.scores[row]):.3f}**\n\n    {prompt!r}\n\n    {completion!r}"
        )
    text = "\n\n---\n\n".join(lines)
    for writer in writers:
        writer.add_text("samples/completions", text, global_step=step)
