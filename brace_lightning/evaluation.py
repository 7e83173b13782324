"""What ``fit``'s validation, ``validate`` and ``test`` log for a batch of on-policy rollouts.

The data module samples the validation prompts (``data/eval_plan.py``: a held-out task split, a
JSONL file or a hub dataset split) with the trainer's current weights; this module logs, under
``val/`` or ``test/``: ``reward`` (the mean reward), ``accuracy``, ``response_length``,
the critic's scores against the realized returns (``value_mse_mc``, a proper score, and the
others of ``metrics.critic_scores``) and the batch's
``mean@n`` and ``pass@k`` (``metrics/pass_at_k.py``), each averaged over the pass's batches
(mean@n and pass@k weighted by prompts, the others by responses). Lightning prints them as the
table at the end of ``validate`` and ``test``.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import MetricCollection

from brace_lightning.data.eval_plan import PROMPTS_KEY
from brace_lightning.metrics.functional import reward_to_go
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.scorer import shift_values


def sampling_keys(info: dict[str, float]) -> list[str]:
    """The mean@n and pass@k keys of a validation batch's ``info``."""
    return [key for key in info if key.startswith(("mean@", "pass@"))]


def log_evaluation_batch(
    module: Any,
    batch: RolloutBatch,
    values: torch.Tensor | None,
    critic: MetricCollection,
    prefix: str,
) -> None:
    """Log one validation (``prefix="val"``) or test (``"test"``) batch of ``module`` (a
    ``BraceModule``).

    Args:
        batch: the rollouts, on the module's device (``[B, T]``).
        values: ``[B, T]`` the critic's outputs on the batch (the value of the prefix ending at
            each token; shifted here with ``shift_values``), None in a critic-free run (no scores).
        critic: the pass's critic scores (``metrics.critic_scores`` with the ``prefix/`` names; one
            per stage, reset by Lightning per pass).
        prefix: ``"val"`` or ``"test"``.
    """
    log = {"batch_size": len(batch)}  # "step" sets the x-axis: the rollout step, as in training
    module.log("step", float(module.rollout_step), reduce_fx="max", **log)
    module.log(f"{prefix}/reward", batch.scores.float().mean(), prog_bar=True, **log)
    module.log(f"{prefix}/response_length", batch.mask.sum(1).float().mean(), **log)
    if batch.correct is not None:
        module.log(f"{prefix}/accuracy", batch.correct.float().mean(), **log)
    if values is not None:
        realized = reward_to_go(batch.rewards, batch.mask, gamma=module.value_target.gamma)
        critic.update(shift_values(values), realized, batch.mask)
        module.log_dict(critic, **log)
    prompts = int(batch.info.get(PROMPTS_KEY, 0))
    for key in sampling_keys(batch.info):
        module.log(f"{prefix}/{key}", float(batch.info[key]), batch_size=prompts)
