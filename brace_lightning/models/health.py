"""Checks that a model's weights are still numbers before anyone samples with them.

A diverged actor (a learning rate far too high, an exploding update) can leave NaN or inf in its
weights while every loss so far was finite. Published unchecked, those weights reach the rollout
engine, whose sampler then draws from a NaN distribution and fails somewhere unrelated (an index
out of bounds). :func:`require_finite_weights` runs where weights are published, so the run stops
at the step that broke them, with a sentence that says so.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def nonfinite_names(weights: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors of ``weights`` holding a NaN or an inf, in order.

    One sum per floating-point tensor (NaN and inf propagate through it) and one host sync for the
    whole model; only when a sum is not finite — also when finite but huge values overflow it — is
    each such tensor checked element by element, so no false alarm is raised.
    """
    tensors = [(n, t.detach()) for n, t in weights.items() if t.is_floating_point() and t.numel()]
    if not tensors:
        return []
    device = tensors[0][1].device
    sums = torch.stack([t.sum(dtype=torch.float32).to(device) for _, t in tensors])
    if bool(torch.isfinite(sums).all()):
        return []
    suspects = [i for i, ok in enumerate(torch.isfinite(sums).tolist()) if not ok]
    return [tensors[i][0] for i in suspects if not bool(torch.isfinite(tensors[i][1]).all())]


def nonfinite_message(bad: list[str], total: int, rollout_step: int) -> str:
    """The sentence of :func:`require_finite_weights` for the non-finite tensors ``bad``."""
    return (
        f"the actor's weights became non-finite at rollout step {rollout_step} ({len(bad)} of "
        f"{total} tensors, first {bad[0]!r}), so they were not published to the rollout "
        "engine; expected finite weights (lower the actor's learning rate or set max_grad_norm)."
    )


def require_finite_weights(weights: Mapping[str, torch.Tensor], *, rollout_step: int) -> None:
    """Raise FloatingPointError naming the first non-finite tensor of the actor's ``weights``
    (see :func:`nonfinite_names` for the cost)."""
    bad = nonfinite_names(weights)
    if bad:
        total = sum(1 for t in weights.values() if t.is_floating_point() and t.numel())
        raise FloatingPointError(nonfinite_message(bad, total, rollout_step))


def require_finite_loss(what: str, loss: torch.Tensor, *, rollout_step: int) -> None:
    """Raise FloatingPointError when a scalar ``loss`` (named ``what``) is not finite."""
    if not bool(torch.isfinite(loss)):
        raise FloatingPointError(
            f"rollout step {rollout_step}: the {what} is {float(loss)}; expected a finite "
            "value (check learning rates, log-prob clamping and the rewards)."
        )


def require_finite_logprobs(
    logprobs: torch.Tensor, mask: torch.Tensor, *, rollout_step: int
) -> None:
    """Raise FloatingPointError when the actor's ``[B, T]`` log-probs are not finite at an action
    (``mask`` True): its weights are finite but so large that its outputs are NaN."""
    at_actions = torch.where(mask, logprobs, torch.zeros((), dtype=logprobs.dtype))
    if bool(torch.isfinite(at_actions.sum())) or bool(torch.isfinite(at_actions).all()):
        return
    bad = int((~torch.isfinite(at_actions)).sum())
    raise FloatingPointError(
        f"the actor's log-probs are not finite at {bad} action tokens at rollout step "
        f"{rollout_step}: its weights have diverged; expected finite log-probs (lower the actor's "
        "learning rate or set max_grad_norm)."
    )
