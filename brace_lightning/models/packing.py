"""Packed sequences: the real tokens of a micro-batch concatenated into one row, no padding.

:func:`packed_token_logprobs` gives the same ``[B, T]`` log-probs (and entropy) as
:func:`~brace_lightning.models.policy.token_logprobs` on the padded rows, but runs the model on one
row of ``N = attention_mask.sum()`` tokens whose position ids restart at 0 at every original row.
With no attention mask, transformers (5.x, ``masking_utils.find_packed_sequence_indices``) reads the
restarts from the position ids and builds a block-diagonal causal mask (SDPA/eager), or passes
cumulative sequence lengths to flash-attention varlen kernels, so no token attends across rows.
"""

from __future__ import annotations

import torch
from torch import nn

from brace_lightning.models.chunked import (
    chunked_head_logprobs,
    final_hidden_states,
    linear_lm_head,
)
from brace_lightning.models.policy import DEFAULT_CHUNK_SIZE, position_ids_from_attention_mask


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The real tokens of left-padded rows as one row, and their per-row position ids.

    Args:
        input_ids: ``[B, T]`` long.
        attention_mask: ``[B, T]`` bool or integer, True at real tokens.

    Returns:
        ``(packed_ids, position_ids)``, both ``[1, N]`` long, rows in order.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"pack_rows got attention_mask of shape {tuple(attention_mask.shape)}; expected "
            f"[B, T] equal to input_ids' {tuple(input_ids.shape)}."
        )
    real = attention_mask.bool()
    positions = position_ids_from_attention_mask(attention_mask)
    return input_ids[real][None], positions[real][None]


def packed_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~brace_lightning.models.policy.token_logprobs` computed on the packed rows.

    Args:
        model: a Hugging Face causal LM whose LM head is an ``nn.Linear``
            (:func:`~brace_lightning.models.chunked.linear_lm_head`).
        input_ids: ``[B, T]`` long, prompts left-padded.
        attention_mask: ``[B, T]`` bool or integer, True at real tokens.
        temperature: the sampling temperature; must be > 0.
        return_entropy: also return the per-position entropy.
        chunk_size: positions whose logits are computed at once.

    Returns:
        ``(logprobs, entropy)`` laid out ``[B, T]`` like ``token_logprobs``.
    """
    head = linear_lm_head(model)
    if head is None:
        raise ValueError(
            f"packed_token_logprobs got a {type(model).__name__} whose output embedding is "
            f"{type(model.get_output_embeddings()).__name__}; expected a plain nn.Linear LM head."
        )
    packed_ids, positions = pack_rows(input_ids, attention_mask)
    hidden = final_hidden_states(model, input_ids=packed_ids, position_ids=positions)[0]  # [N, H]
    scored = positions[0, 1:] != 0  # the next token belongs to the same row
    picked, ent = chunked_head_logprobs(
        hidden[:-1][scored],
        head,
        packed_ids[0, 1:][scored],
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=return_entropy,
    )
    real = attention_mask.bool()

    def unpack(values: torch.Tensor) -> torch.Tensor:
        flat = values.new_zeros(packed_ids.shape[1]).masked_scatter(
            torch.cat([scored.new_zeros(1), scored]), values
        )
        return values.new_zeros(real.shape).masked_scatter(real, flat)

    return unpack(picked), None if ent is None else unpack(ent)
