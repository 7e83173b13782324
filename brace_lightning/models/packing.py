"""Packed sequences: the real tokens of a micro-batch concatenated into one row, no padding.

:func:`packed_token_logprobs` gives the same ``[B, T]`` log-probs (and entropy) as
:func:`~brace_lightning.models.policy.token_logprobs` on the padded rows, but runs the model on one
row of ``N = attention_mask.sum()`` tokens whose position ids restart at 0 at every original row.
With no attention mask, transformers (5.x, ``masking_utils.find_packed_sequence_indices``) reads the
restarts from the position ids and builds a block-diagonal causal mask (SDPA/eager), or passes
cumulative sequence lengths to flash-attention varlen kernels, so no token attends across rows.
:func:`packed_values` does the same for the critic (backbone + value head).

Not every model reads the restarts: a forward without ``position_ids`` (ALiBi models such as
BLOOM or MPT), an attention implementation transformers builds no mask for, or modelling code that
does not pass the position ids to its mask (Falcon) would let tokens attend across rows.
:func:`packing_problem` finds such a model before it is used packed: besides the static checks it
runs the model once on two short rows, packed and one by one, and compares the final hidden states.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    find_packed_sequence_indices,
    sdpa_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from brace_lightning.models.chunked import (
    chunked_head_logit_sq_norms,
    chunked_head_logprobs,
    final_hidden_states,
    linear_lm_head,
)
from brace_lightning.models.critic import ValueModel, transformer_of
from brace_lightning.models.policy import DEFAULT_CHUNK_SIZE, position_ids_from_attention_mask

#: A packed probe row passes when its distance to the rows run one by one is at most this fraction
#: of the distance that attention across the two rows produces (round-off is far below it).
PROBE_TOLERANCE = 0.1

#: The attention implementation :func:`use_varlen_attention` gives an SDPA model: SDPA run row by
#: row over a packed row (attention costs ``Σ nᵢ²``, and no ``N × N`` mask is built), plain SDPA
#: for every other call.
VARLEN_SDPA = "sdpa_varlen"

#: True while :func:`packed_token_logprobs` / :func:`packed_values` run a packed row.
_PACKED_FORWARD: ContextVar[bool] = ContextVar("packed_forward", default=False)


@contextmanager
def packed_forward() -> Iterator[None]:
    """Mark the forwards inside as packed rows (``position_ids`` restart at every original row, no
    attention mask), so that a :data:`VARLEN_SDPA` model builds no block-diagonal mask."""
    token = _PACKED_FORWARD.set(True)
    try:
        yield
    finally:
        _PACKED_FORWARD.reset(token)


def _varlen_sdpa_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """:data:`VARLEN_SDPA`'s mask: none for a packed row (the attention splits it), else SDPA's."""
    return None if _PACKED_FORWARD.get() else sdpa_mask(*args, **kwargs)


def row_lengths(position_ids: torch.Tensor) -> list[int] | None:
    """The lengths of the rows packed into ``[1, N]`` position ids, split where transformers'
    packed-sequence masks split them (``find_packed_sequence_indices``: wherever the position does
    not follow on by 1); None for one row or a batch of rows."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] < 2:
        return None
    row_of_token = find_packed_sequence_indices(position_ids)
    if row_of_token is None:
        return None
    return torch.bincount(row_of_token[0]).tolist()


def varlen_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, run on each row of a packed row separately.

    A call with no mask, one ``[1, N]`` query as long as its keys and ``position_ids`` that restart
    (a packed training row) is split at the restarts and each row attends causally to itself, as
    flash-attention's varlen kernels do; any other call (padded rows, generation with a cache) is
    plain ``sdpa_attention_forward``.
    """
    position_ids = kwargs.get("position_ids")
    lengths = None
    if attention_mask is None and position_ids is not None and query.shape[2] == key.shape[2]:
        lengths = row_lengths(position_ids)
    if lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = [
        sdpa_attention_forward(module, q, k, v, None, **kwargs)[0]
        for q, k, v in zip(
            query.split(lengths, dim=2),
            key.split(lengths, dim=2),
            value.split(lengths, dim=2),
            strict=True,
        )
    ]
    return torch.cat(outputs, dim=1), None  # [1, N, heads, head_dim]


ALL_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, varlen_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, _varlen_sdpa_mask)


def use_varlen_attention(model: nn.Module) -> bool:
    """Switch ``model`` (a causal LM or a ValueModel) from ``sdpa`` to :data:`VARLEN_SDPA`, which
    gives the same numbers on every call and runs packed rows without an ``N × N`` mask. Other
    implementations (flash-attention varlen kernels, eager, flex) are left alone, and so is a model
    with a sliding attention window (Mistral, Gemma 2/3): the row-by-row attention is causal over
    the whole row, while SDPA's mask keeps the window. Returns whether the model now uses it."""
    config = transformer_of(model).config
    text = config.get_text_config()
    windowed = getattr(text, "sliding_window", None) is not None and getattr(
        text, "use_sliding_window", True
    )
    if config._attn_implementation == "sdpa" and not windowed:
        config._attn_implementation = VARLEN_SDPA
    return config._attn_implementation == VARLEN_SDPA


def prepare_packing(model: nn.Module) -> str | None:
    """Ready ``model`` for packed rows and say whether it can run them (:func:`packing_problem`).

    An SDPA model is switched to :data:`VARLEN_SDPA` when its packed rows are right that way;
    a model whose own code reads the implementation's name (Falcon branches on ``"sdpa"``) is
    switched back and checked with SDPA's block-diagonal mask.
    """
    config = transformer_of(model).config
    before = config._attn_implementation
    if use_varlen_attention(model):
        problem = packing_problem(model)
        if problem is None or before == VARLEN_SDPA:
            return problem
        config._attn_implementation = before
    return packing_problem(model)


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


def unpack_rows(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` per-token values of a packed row laid out as the padded ``[B, T]`` rows, 0 at
    padding (differentiable); the inverse of :func:`pack_rows`."""
    return values.new_zeros(attention_mask.shape).masked_scatter(attention_mask.bool(), values)


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
    head, hidden, targets, unpack = _packed_head_inputs(
        "packed_token_logprobs", model, input_ids, attention_mask
    )
    picked, ent = chunked_head_logprobs(
        hidden,
        head,
        targets,
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=return_entropy,
    )
    return unpack(picked), None if ent is None else unpack(ent)


def packed_token_logit_sq_norms(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """:func:`~brace_lightning.models.policy.token_logit_sq_norms` computed on the packed rows
    (the arguments are :func:`packed_token_logprobs`'); no graph is built."""
    with torch.no_grad():
        head, hidden, targets, unpack = _packed_head_inputs(
            "packed_token_logit_sq_norms", model, input_ids, attention_mask
        )
        norms = chunked_head_logit_sq_norms(
            hidden, head, targets, temperature=temperature, chunk_size=chunk_size
        )
        return unpack(norms)


def _packed_head_inputs(
    caller: str, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[nn.Linear, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """One packed forward of left-padded rows to the LM head's input: the head, the ``[N, H]``
    hidden states of the positions whose next token is in the same row, those ``[N]`` tokens,
    and the map that lays ``[N]`` per-position values out as the ``[B, T]`` rows (each at its
    token's own column, 0 elsewhere)."""
    head = linear_lm_head(model)
    if head is None:
        raise ValueError(
            f"{caller} got a {type(model).__name__} whose output embedding is "
            f"{type(model.get_output_embeddings()).__name__}; expected a plain nn.Linear LM head."
        )
    packed_ids, positions = pack_rows(input_ids, attention_mask)
    with packed_forward():
        hidden = final_hidden_states(model, input_ids=packed_ids, position_ids=positions)[0]
    scored = positions[0, 1:] != 0  # the next token belongs to the same row
    predicted = torch.cat([scored.new_zeros(1), scored])  # positions with a scored predecessor

    def unpack(values: torch.Tensor) -> torch.Tensor:
        flat = values.new_zeros(packed_ids.shape[1])
        return unpack_rows(flat.masked_scatter(predicted, values), attention_mask)

    return head, hidden[:-1][scored], packed_ids[0, 1:][scored], unpack


def packed_values(
    critic: ValueModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The critic's ``[B, T]`` values (as ``critic(input_ids, attention_mask)``) computed on the
    packed rows: one backbone pass over the real tokens with per-row position ids, no mask."""
    packed_ids, positions = pack_rows(input_ids, attention_mask)
    with packed_forward():
        values = critic(packed_ids, position_ids=positions)[0]  # [N]
    return unpack_rows(values, attention_mask)


def packing_problem(model: nn.Module) -> str | None:
    """Why packed rows would not give ``model`` the numbers of padded rows; None when they do.

    Checks that the base model's ``forward`` takes ``position_ids``, that transformers builds
    masks for its attention implementation, that an actor's logits are a plain linear head (packed
    log-probs use the chunked path), and then runs the model (eval mode, no grad) on a 4-token and
    a 6-token row: the second row's final hidden states, packed behind the first, must equal those
    of the row alone up to :data:`PROBE_TOLERANCE` times the change that attending to the first
    row causes (catches modelling code that ignores the restarts, such as Falcon's).

    Args:
        model: a Hugging Face causal LM or a :class:`~brace_lightning.models.critic.ValueModel`,
            possibly sharded with FSDP2 (it is called through its own ``forward``).

    Returns:
        One clause naming the reason, or None.
    """
    critic = isinstance(model, ValueModel)
    base = transformer_of(model)
    if "position_ids" not in inspect.signature(base.forward).parameters:
        return f"{type(base).__name__}.forward takes no position_ids"
    attention = getattr(base.config, "_attn_implementation", None)
    if attention not in ALL_MASK_ATTENTION_FUNCTIONS:
        return f"transformers builds no packed-sequence mask for attention {attention!r}"
    if not critic and linear_lm_head(model) is None:
        return "its logits are not a plain linear head of the hidden states"
    device = next(model.parameters()).device
    vocab = base.config.get_text_config().vocab_size
    ids = torch.randint(1, vocab, (1, 10), generator=torch.Generator().manual_seed(0)).to(device)
    restart = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]], device=device)

    def hidden(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if not critic:
            return final_hidden_states(model, input_ids=input_ids, position_ids=position_ids)[0]
        captured: list[torch.Tensor] = []
        handle = base.register_forward_hook(
            lambda _module, _args, out: captured.append(out.last_hidden_state)
        )
        try:
            model(input_ids, position_ids=position_ids)
        finally:
            handle.remove()
        return captured[0][0]

    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = hidden(ids[:, 4:], restart[:, 4:]).float()
            with packed_forward():
                packed = hidden(ids, restart)[4:].float()
            joined = hidden(ids, torch.arange(10, device=device)[None])[4:].float()
    except (RuntimeError, TypeError, ValueError) as error:  # modelling code that cannot run it
        return f"a packed forward failed ({type(error).__name__}: {error})"
    finally:
        model.train(training)
    packed_error = float((packed - alone).norm())
    crossed_error = float((joined - alone).norm())
    if not packed_error <= PROBE_TOLERANCE * crossed_error:
        return (
            f"its packed rows do not match the rows run one by one (distance {packed_error:.3g}, "
            f"against {crossed_error:.3g} when the rows attend to each other)"
        )
    return None
