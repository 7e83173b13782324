"""How a training step's metrics reach Lightning: through ``LightningModule.log_dict``.

The module computes one dict of scalars per rollout step, already combined over ranks
(:func:`brace_lightning.module.combine_rank_metrics`), so every rank logs the same values and no
``sync_dist`` is needed. Logging them with ``self.log_dict`` (not ``logger.log_metrics``) puts them
in ``trainer.callback_metrics``, where ``ModelCheckpoint(monitor="rollout/reward")`` and
``EarlyStopping`` find them. A logged ``"step"`` key sets the logger's x-axis (Lightning's
convention), so TensorBoard stays indexed by rollout step rather than by optimizer step;
``trainer.log_every_n_steps`` applies as usual (the configs set 1).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from brace_lightning.rollout.types import RolloutBatch

#: ``data/*`` entries of the batch info that repeat a ``rollout/*`` metric under another name.
DUPLICATE_INFO = frozenset({"mean_score", "accuracy", "mean_response_length"})

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
    """``lr/actor`` and ``lr/critic``: each optimizer's current learning rate (first group)."""
    actor_opt, critic_opt = module.optimizers()
    return {
        "lr/actor": float(actor_opt.param_groups[0]["lr"]),
        "lr/critic": float(critic_opt.param_groups[0]["lr"]),
    }


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
