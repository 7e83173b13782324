"""Micro-batch planning: rows of a minibatch grouped by length under a row count and a token budget.

A micro-batch is padded to its widest row, so a minibatch whose responses range from 50 to 8000
tokens spends most of a fixed-row-count forward on padding. :func:`plan_micro_batches` sorts the rows
by their number of real tokens (longest first) and fills each micro-batch greedily while

- it holds at most ``max_rows`` rows, and
- ``rows × width`` stays within ``max_tokens`` (``width`` = the columns that hold a real token of
  any of its rows; all-padding columns at either end are cut off).

With ``packed=True`` (the trainer's ``pack_sequences``: a micro-batch runs as one row of its real
tokens, ``models/packing.py``) the budget counts real tokens only: their sum over the micro-batch's
rows stays within ``max_tokens``. A row above ``max_tokens`` gets a micro-batch of its own. The
plan changes only how the minibatch is cut, never what is computed: the trainer sums per-token
losses and divides by the minibatch's global action-token count, so losses and gradients do not
depend on the budget (up to float round-off; ``tests/test_microbatch.py`` checks it against one big
batch, ``tests/test_packing.py`` packed against padded).

Under data parallelism every rank must run the same number of forwards (FSDP2 gathers weights in
each) and backwards (DDP reduces gradients in each). :func:`equalize` splits a rank's plan until it
has the largest count of all ranks, adding zero-weight filler micro-batches (one row, whose loss is
multiplied by 0) when no micro-batch can be split any further.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MicroBatch:
    """Rows of a minibatch processed in one forward/backward.

    Attributes:
        rows: ``[n]`` long indices into the minibatch.
        columns: the column window holding every real token of these rows.
        weight: 1.0, or 0.0 for a filler that only keeps the ranks' forward/backward counts equal.
    """

    rows: torch.Tensor
    columns: slice
    weight: float = 1.0

    @property
    def tokens(self) -> int:
        """Padded size ``rows × width`` of the micro-batch."""
        return len(self.rows) * (self.columns.stop - self.columns.start)


def _window(real: torch.Tensor) -> slice:
    """Columns from the first to the last True of ``real`` (``[T]`` bool; empty → column 0)."""
    hits = real.nonzero().flatten()
    if len(hits) == 0:
        return slice(0, 1)
    return slice(int(hits[0]), int(hits[-1]) + 1)


def plan_micro_batches(
    attention_mask: torch.Tensor,
    *,
    max_rows: int | None = None,
    max_tokens: int | None = None,
    packed: bool = False,
) -> list[MicroBatch]:
    """Group the rows of ``attention_mask`` into micro-batches, longest rows first.

    Args:
        attention_mask: ``[B, T]`` bool or integer, True at real tokens.
        max_rows: at most this many rows per micro-batch (None = no limit).
        max_tokens: at most this many tokens per micro-batch, except for a single row above it
            (None = no limit): padded tokens (rows × window width), or real tokens with ``packed``.
        packed: the micro-batches run packed (no padding), so only real tokens count.

    Returns:
        Micro-batches covering every row exactly once.
    """
    for name, value in (("max_rows", max_rows), ("max_tokens", max_tokens)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"plan_micro_batches got {name}={value!r}; expected None or >= 1.")
    real = attention_mask.bool().cpu()
    counts = real.sum(dim=1)
    lengths = counts.tolist()
    order = torch.argsort(counts, descending=True, stable=True)
    plan: list[MicroBatch] = []
    rows: list[int] = []
    union = torch.zeros(real.shape[1], dtype=torch.bool)
    for row in order.tolist():
        grown = union | real[row]
        if packed:
            cost = sum(lengths[r] for r in rows) + lengths[row]
        else:
            window = _window(grown)
            cost = (len(rows) + 1) * (window.stop - window.start)
        fits = max_rows is None or len(rows) < max_rows
        if max_tokens is not None and cost > max_tokens:
            fits = False
        if rows and not fits:
            plan.append(MicroBatch(torch.tensor(rows), _window(union)))
            rows, grown = [], real[row].clone()
        rows.append(row)
        union = grown
    if rows:
        plan.append(MicroBatch(torch.tensor(rows), _window(union)))
    device = attention_mask.device
    return [MicroBatch(m.rows.to(device), m.columns) for m in plan]


def equalize(plan: list[MicroBatch], count: int, attention_mask: torch.Tensor) -> list[MicroBatch]:
    """``plan`` grown to ``count`` micro-batches (the largest count over the ranks).

    The micro-batch with the most rows is halved while one has two rows or more; after that,
    zero-weight fillers (the plan's narrowest row) are appended.
    """
    plan = list(plan)
    real = attention_mask.bool()
    while len(plan) < count:
        widest = max(range(len(plan)), key=lambda i: len(plan[i].rows))
        micro = plan[widest]
        if len(micro.rows) >= 2:
            halves = micro.rows.tensor_split(2)
            plan[widest : widest + 1] = [
                MicroBatch(half, _window(real[half].any(dim=0).cpu())) for half in halves
            ]
            continue
        narrowest = min(plan, key=lambda m: m.tokens)
        plan.append(MicroBatch(narrowest.rows[:1], narrowest.columns, weight=0.0))
    return plan


def widen(values: torch.Tensor, columns: slice, width: int) -> torch.Tensor:
    """Per-column values of a column window ``[n, w]`` placed back at full width ``[n, width]``
    (zeros outside the window; differentiable)."""
    return F.pad(values, (columns.start, width - columns.stop))


def score_rows(
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    plan: list[MicroBatch],
) -> torch.Tensor:
    """``score(input_ids, attention_mask)`` ``[B, T]`` computed micro-batch by micro-batch.

    Args:
        score: maps ``[n, w]`` ids and attention mask to ``[n, w]`` per-column values (0 at
            padding), e.g. token log-probs or the critic's values.
        input_ids: ``[B, T]`` long.
        attention_mask: ``[B, T]``.
        plan: the micro-batches (fillers are run, for the ranks' collective calls, and dropped).

    Returns:
        ``[B, T]`` values, zeros outside every micro-batch's window.
    """
    out: torch.Tensor | None = None
    for micro in plan:
        cols = micro.columns
        part = score(input_ids[micro.rows, cols], attention_mask[micro.rows, cols])
        if out is None:
            out = part.new_zeros(input_ids.shape)
        if micro.weight:
            out[micro.rows, cols] = part
    if out is None:
        raise ValueError("score_rows got an empty plan; expected at least one micro-batch.")
    return out
