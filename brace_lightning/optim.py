"""The PPO update's optimizer plumbing: default optimizers, one clipped step, one global step per
rollout step, schedulers by network.

The module has two optimizers (actor, critic) under manual optimization; every minibatch steps the
critic's and, after the critic warm-up, the actor's. Each network's gradient norm is clipped on its
own (``max_grad_norm``). A critic-free value target (GRPO, Dr. GRPO, RLOO) builds no critic: then
there is one optimizer (the actor's), and the critic's optimizer and scheduler are not built.

Lightning counts every ``LightningOptimizer.step`` of a manual-optimization module as one global
step (the manual loop's ``optim_step_progress``, advanced by the optimizer's ``_on_before_step`` /
``_on_after_step`` hooks), which would make ``trainer.global_step`` count ppo_epochs ×
num_minibatches × 2 steps per rollout batch. :func:`one_global_step` counts the update's steps as
one, so ``max_steps``, ``ModelCheckpoint(every_n_train_steps)``, ``val_check_interval`` and
``log_every_n_steps`` are in rollout steps. Every step still goes through
``LightningOptimizer.step`` and so through the strategy and its precision plugin (gradient scaling,
FSDP). :func:`step_schedulers` steps each network's LR scheduler once per rollout step in which
its optimizer stepped, so a scheduler's period is in rollout steps too.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
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


#: Gradient clips waiting for Lightning's ``on_before_optimizer_step`` of their optimizer (by id).
_PENDING_CLIPS: dict[int, Callable[[], None]] = {}


def clipped_step(
    model: nn.Module,
    optimizer: Any,
    max_grad_norm: float | None,
    device: torch.device,
    lr_scale: float | None = None,
) -> torch.Tensor:
    """Clip ``model``'s gradient norm to ``max_grad_norm`` (None: no clipping), step ``optimizer``
    and zero the gradients; the gradient norm before clipping (0 when no parameter has one).

    Through a ``LightningOptimizer`` the clip runs inside the step, in the module's
    ``on_before_optimizer_step`` (:func:`clip_before_step`): after the precision plugin has
    unscaled the gradients (``16-mixed``'s GradScaler; clipping scaled gradients would clip them
    to ~1/scale) and right before the update. A plain torch optimizer is clipped, then stepped.

    ``lr_scale`` s (an adaptive step size, ``step_size.py``): this one step runs with every
    parameter group's lr times s, then the lr is restored (schedulers and checkpoints see the
    unscaled value). The lr, not the loss, is scaled: AdamW is invariant to the loss's scale.
    """
    norm = torch.zeros((), device=device)

    def clip() -> None:
        nonlocal norm
        norm = _clip_grad_norm(model, max_grad_norm, device)

    with _scaled_lr(optimizer, lr_scale):
        if not isinstance(optimizer, LightningOptimizer):
            clip()
            optimizer.step()
        else:
            key = id(optimizer.optimizer)
            _PENDING_CLIPS[key] = clip
            try:
                optimizer.step()
            finally:
                missed = _PENDING_CLIPS.pop(key, None)
            assert missed is None, "the precision plugin stepped without on_before_optimizer_step"
    optimizer.zero_grad(set_to_none=True)
    return norm


def clip_before_step(optimizer: torch.optim.Optimizer) -> None:
    """Run the clip :func:`clipped_step` left for ``optimizer`` (Lightning's raw optimizer, as
    ``on_before_optimizer_step`` receives it); nothing when none is pending."""
    clip = _PENDING_CLIPS.pop(id(optimizer), None)
    if clip is not None:
        clip()


def _clip_grad_norm(
    model: nn.Module, max_grad_norm: float | None, device: torch.device
) -> torch.Tensor:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), device=device)
    max_norm = math.inf if max_grad_norm is None else max_grad_norm
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm).detach()
    # FSDP2: the norm of DTensor gradients is a replicated DTensor (the global norm).
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


@contextlib.contextmanager
def _scaled_lr(optimizer: Any, lr_scale: float | None) -> Iterator[None]:
    """Every parameter group's lr times ``lr_scale`` inside the block, restored after (None: as is)."""
    if lr_scale is None:
        yield
        return
    groups = optimizer.param_groups
    saved = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = group["lr"] * lr_scale
    try:
        yield
    finally:
        for group, lr in zip(groups, saved, strict=True):
            group["lr"] = lr


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


def actor_lr(module: pl.LightningModule) -> float:
    """The actor optimizer's current lr (the largest of its parameter groups'), before any
    adaptive step-size factor."""
    actor_opt, _ = optimizers_by_network(module)
    return max(float(group["lr"]) for group in actor_opt.param_groups)


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


def _no_count() -> None:
    """Stands in for the manual loop's step-counting hooks inside :func:`one_global_step`."""


@contextlib.contextmanager
def one_global_step(module: pl.LightningModule) -> Iterator[None]:
    """Count the optimizer steps of ``module`` inside the block as one Lightning global step.

    The manual loop's counting hooks of every optimizer are set aside for the block and run once
    after it (not after an exception); the steps themselves, and everything the strategy and its
    precision plugin do in them, are unchanged.
    """
    optimizers = module.optimizers(use_pl_optimizer=True)
    optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
    optimizers = [o for o in optimizers if isinstance(o, LightningOptimizer)]
    hooks = [(o._on_before_step, o._on_after_step) for o in optimizers]
    for optimizer in optimizers:
        optimizer._on_before_step = optimizer._on_after_step = _no_count
    try:
        yield
    finally:
        for optimizer, (before, after) in zip(optimizers, hooks, strict=True):
            optimizer._on_before_step, optimizer._on_after_step = before, after
    if hooks:
        before, after = hooks[0]
        before()
        after()


def step_schedulers(module: pl.LightningModule, trained: tuple[bool, bool]) -> None:
    """Step the (actor, critic) LR schedulers of ``module`` whose network was ``trained`` in this
    rollout step: once per rollout step, so a scheduler's period (``T_max``, ``step_size``) counts
    rollout steps in which its network stepped (the actor's starts after the critic warm-up)."""
    for scheduler, stepped in zip(schedulers_by_network(module), trained, strict=True):
        if scheduler is not None and stepped:
            scheduler.step()


@contextlib.contextmanager
def rollout_update(module: pl.LightningModule, trained: tuple[bool, bool]) -> Iterator[None]:
    """The update of one rollout step as Lightning and the schedulers see it: its optimizer steps
    count as one global step (:func:`one_global_step`), and the (actor, critic) schedulers whose
    network is ``trained`` step once after it (:func:`step_schedulers`)."""
    with one_global_step(module):
        yield
    step_schedulers(module, trained)
