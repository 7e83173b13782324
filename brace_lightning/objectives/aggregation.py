"""Loss aggregation: how a per-token loss ``[B, T]`` becomes the scalar that is differentiated.

Three modes (verl's ``loss_agg_mode`` names with underscores), with n_i the actions of row i, N the
action tokens and B the rows of the optimizer step (all ranks, all micro-batches):

    token_mean           Σ_i Σ_t ℓ_it / N                 every token counts the same (default)
    seq_mean_token_sum   (1/B) Σ_i Σ_t ℓ_it / L           L = max_len (a constant) or 1
    seq_mean_token_mean  (1/B) Σ_i (Σ_t ℓ_it / n_i)       every sequence counts the same

TRL 1.16's ``GRPOTrainer(loss_type=...)`` maps onto them: ``"grpo"`` = ``seq_mean_token_mean``;
``"bnpo"`` and ``"dapo"`` = ``token_mean`` (bnpo over the local batch, dapo over the whole step as
here); ``"dr_grpo"`` = ``seq_mean_token_sum`` with ``max_len = max_completion_length`` (Dr. GRPO's
constant normaliser, Liu et al. 2025 §3.1: no length bias).

Each mode is one row factor times one count, so the module keeps a single division by a count
summed over ranks and micro-batches (:func:`weigh`, :func:`counted`) and gradient
accumulation and data parallelism still give one big batch's gradient; :func:`aggregate` is the
same formula on one local batch.
"""

from __future__ import annotations

import torch

MODES: tuple[str, ...] = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


def check_mode(mode: str, max_len: int | None = None) -> None:
    """Raise ValueError unless ``mode`` is one of :data:`MODES` and ``max_len`` None or an int ≥ 1
    (only ``seq_mean_token_sum`` reads it)."""
    if mode not in MODES:
        raise ValueError(f"loss_aggregation must be one of {MODES}; got {mode!r}.")
    if max_len is not None and (
        isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1
    ):
        raise ValueError(f"loss_max_len must be None or an int >= 1; got {max_len!r}.")
    if max_len is not None and mode != "seq_mean_token_sum":
        raise ValueError(
            f"loss_max_len is read by loss_aggregation='seq_mean_token_sum' only; got "
            f"loss_max_len={max_len!r} with loss_aggregation={mode!r}."
        )


def counted(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``[B, T]`` or ``[B]`` bool whose True entries are what the mode divides by: the actions
    (``token_mean``) or the rows (the sequence means)."""
    if mode == "token_mean":
        return mask
    return torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)


def row_factors(
    mask: torch.Tensor,
    mode: str,
    max_len: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor | None:
    """``[B, 1]`` factor (``dtype``) of each row's token losses before the division by the count
    (None for ``token_mean``: no factor, so the default path multiplies by nothing)."""
    if mode == "token_mean":
        return None
    if mode == "seq_mean_token_sum":
        return torch.full((mask.shape[0], 1), 1.0 / (max_len or 1), dtype=dtype, device=mask.device)
    return 1.0 / mask.sum(dim=1, keepdim=True).clamp(min=1).to(dtype)


def weigh(
    token_loss: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int | None = None
) -> torch.Tensor:
    """``token_loss`` ``[B, T]`` times its rows' factors (``token_loss`` itself for
    ``token_mean``); summed and divided by the step's count of :func:`counted`, the mode's loss."""
    factors = row_factors(mask, mode, max_len, token_loss.dtype)
    return token_loss if factors is None else token_loss * factors


def aggregate(
    token_loss: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int | None = None
) -> torch.Tensor:
    """The scalar loss of ``token_loss`` ``[B, T]`` over the actions of ``mask`` ``[B, T]`` (bool)
    in ``mode`` (module docstring), for one local batch."""
    check_mode(mode, max_len)
    loss = weigh(torch.where(mask, token_loss, 0.0), mask, mode, max_len)
    return loss.sum() / counted(mask, mode).sum().clamp(min=1)


class LossAggregation:
    """A mode and its ``max_len``, checked once (``BraceModule``'s ``loss_aggregation`` and
    ``loss_max_len``); :meth:`weigh` is :func:`weigh` with them."""

    def __init__(self, mode: str = "token_mean", max_len: int | None = None) -> None:
        check_mode(mode, max_len)
        self.mode = mode
        self.max_len = max_len

    def weigh(self, token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """:func:`weigh` of ``token_loss`` and ``mask`` ``[B, T]`` in this mode."""
        return weigh(token_loss, mask, self.mode, self.max_len)
