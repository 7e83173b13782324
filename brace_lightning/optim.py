"""The PPO update's optimizer plumbing: default optimizers, one clipped step, schedulers by network.

The module has two optimizers (actor, critic) under manual optimization; every minibatch steps the
critic's and, after the critic warm-up, the actor's. Each network's gradient norm is clipped on its
own (``max_grad_norm``), and a network's LR scheduler steps only when its optimizer did. A
critic-free value target (GRPO, Dr. GRPO, RLOO) builds no critic: then there is one optimizer (the
actor's), and the critic's optimizer and scheduler arguments are not built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.tensor import DTensor

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def adamw(lr: float) -> OptimizerFactory:
    """AdamW at ``lr`` with torch's other defaults (the paper's actor 1e-6 / critic 1e-5)."""

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr)

    return build


def with_defaults(
    actor: OptimizerFactory | None, critic: OptimizerFactory | None
) -> tuple[OptimizerFactory, OptimizerFactory]:
    """The (actor, critic) optimizer factories, the paper's AdamW (1e-6 / 1e-5) where None."""
    return actor or adamw(1e-6), critic or adamw(1e-5)


def clipped_step(
    model: nn.Module,
    optimizer: Any,
    max_grad_norm: float | None,
    device: torch.device,
    lr_scale: float | None = None,
) -> torch.Tensor:
    """Clip ``model``'s gradient norm to ``max_grad_norm`` (None: no clipping), step ``optimizer``
    and zero the gradients; the gradient norm before clipping (0 when no parameter has one).

    ``lr_scale`` s (an adaptive step size, ``step_size.py``): this one step runs with every
    parameter group's lr times s, then the lr is restored (schedulers and checkpoints see the
    unscaled value). The lr, not the loss, is scaled: AdamW is invariant to the loss's scale.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.zeros((), device=device)
    if params:
        max_norm = math.inf if max_grad_norm is None else max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm).detach()
        # FSDP2: the norm of DTensor gradients is a replicated DTensor (the global norm).
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    if lr_scale is None:
        optimizer.step()
    else:
        groups = optimizer.param_groups
        saved = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * lr_scale
        try:
            optimizer.step()
        finally:
            for group, lr in zip(groups, saved, strict=True):
                group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    return norm


def configure_optimizers(
    actor: nn.Module,
    critic: nn.Module | None,
    optimizers: tuple[OptimizerFactory, OptimizerFactory],
    schedulers: tuple[Callable[[Any], Any] | None, Callable[[Any], Any] | None],
) -> tuple[list[torch.optim.Optimizer], list[dict[str, Any]]]:
    """Lightning's ``configure_optimizers`` value: the (actor, critic) optimizers built by the
    ``optimizers`` factories (the actor's only when ``critic`` is None) and their step-wise
    schedulers from the ``schedulers`` factories (None: no scheduler)."""
    networks = (actor,) if critic is None else (actor, critic)
    # Only trainable parameters: with LoRA (models/lora.py) the frozen base is left out.
    opts = [
        factory(p for p in net.parameters() if p.requires_grad)
        for factory, net in zip(optimizers, networks, strict=False)
    ]
    scheduled = [
        {"scheduler": factory(opt), "interval": "step"}
        for opt, factory in zip(opts, schedulers, strict=False)
        if factory is not None
    ]
    return opts, scheduled


def optimizers_by_network(module: pl.LightningModule) -> tuple[Any, Any]:
    """``module``'s (actor, critic) optimizers; the critic's None in a critic-free run."""
    opts = module.optimizers()
    if not isinstance(opts, list):
        return opts, None
    return opts[0], opts[1]


def step_schedulers(module: pl.LightningModule, *, actor_stepped: bool) -> None:
    """Step the critic's scheduler and, if its optimizer stepped, the actor's (each if present)."""
    for scheduler, trained in zip(
        schedulers_by_network(module), (actor_stepped, True), strict=True
    ):
        if scheduler is not None and trained:
            scheduler.step()


def schedulers_by_network(module: pl.LightningModule) -> tuple[Any, Any]:
    """The LR schedulers of ``module``'s (actor, critic) optimizers; None where there is none."""
    schedulers = module.lr_schedulers()
    if schedulers is None:
        return None, None
    if not isinstance(schedulers, list):
        schedulers = [schedulers]
    by_opt = {id(s.optimizer): s for s in schedulers}
    actor_opt, critic_opt = optimizers_by_network(module)
    critic = None if critic_opt is None else by_opt.get(id(critic_opt.optimizer))
    return by_opt.get(id(actor_opt.optimizer)), critic
