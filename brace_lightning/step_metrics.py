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

from collections.abc import Mapping

import lightning.pytorch as pl

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
