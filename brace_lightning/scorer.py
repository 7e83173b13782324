"""Forwards of a rollout batch, micro-batch by micro-batch, on packed or padded rows.

The PPO update reads log-probs of several actor-shaped models (the actor, the EWMA and reference
copies) and the critic's values over the same rows. :class:`Scorer` owns the two decisions that
shape those forwards:

- the micro-batch plan (``models/microbatch.py``): rows sorted by length under ``micro_batch_size``
  and ``max_tokens_per_micro_batch``, and, under data parallelism, grown to the largest count of
  any rank (a ``reduce_max`` over ranks, handed in by the caller);
- packing (``models/packing.py``), decided once by :meth:`Scorer.prepare` (the LightningModule's
  ``configure_model``): ``pack_sequences`` and both the actor and the critic can pack. Preparing
  switches an SDPA model to row-by-row attention; a model that cannot pack makes it log one
  sentence and keep padded rows, so the token budget always counts what is computed.

One pass is not micro-batched: :meth:`Scorer.score_sq_norms`, each response's squared
score-gradient norm (one forward and backward per row), for a value target that reads it (VCPO's
optimal baseline, ``targets/groups.py``). Its forward-only proxy, :meth:`Scorer.logit_sq_norms`
(the norm with respect to the logits, verl's), runs on the micro-batch plan like the scoring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule

from brace_lightning.models.microbatch import MicroBatch, equalize, plan_micro_batches, score_rows
from brace_lightning.models.packing import (
    packed_token_logit_sq_norms,
    packed_token_logprobs,
    packed_values,
    prepare_packing,
)
from brace_lightning.models.policy import token_logit_sq_norms, token_logprobs
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.targets import ValueTarget


def shift_values(values: torch.Tensor) -> torch.Tensor:
    """Critic outputs ``[B, T]`` (value of the prefix ending at t) → value of the state before the
    token at t, stored at column t (column 0 gets 0)."""
    return torch.nn.functional.pad(values[:, :-1], (1, 0))


@dataclasses.dataclass
class Scored:
    """What the PPO epochs read, all ``[B, T]`` and without grad: the proximal log-probs
    (``proximal``), the EWMA actor's (None: π_prox is the actor), log π_ref for the actor loss's KL
    term (None without one), the critic's values before the update, the critic targets and the
    (whitened) advantages."""

    proximal: torch.Tensor
    ewma: torch.Tensor | None
    reference: torch.Tensor | None
    old_values: torch.Tensor
    returns: torch.Tensor
    advantages: torch.Tensor

    def rows(self, rows: torch.Tensor) -> Scored:
        """The same tensors for minibatch ``rows``."""
        fields = (getattr(self, field.name) for field in dataclasses.fields(self))
        return Scored(*(None if t is None else t[rows] for t in fields))


class Scorer:
    """Micro-batched forwards of actor-shaped models and the critic.

    Args:
        micro_batch_size: rows per forward/backward (None = the whole minibatch).
        max_tokens: padded tokens per forward/backward, or real tokens when packed (None = no budget).
        pack_sequences: run forwards on packed rows where both models can.
    """

    def __init__(
        self, *, micro_batch_size: int | None, max_tokens: int | None, pack_sequences: bool
    ) -> None:
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens
        self.pack_sequences = pack_sequences
        self.packed: bool | None = None  # decided by prepare()

    def prepare(
        self,
        actor: nn.Module,
        critic: nn.Module | None,
        copies: Iterable[nn.Module],
        value_target: ValueTarget | None = None,
    ) -> None:
        """Decide packing once (later calls change nothing; ``critic`` None: a critic-free run)
        and make ``copies`` of the actor (EWMA, reference) attend like it. A ``value_target``
        that reads :meth:`score_sq_norms` is refused for an FSDP2-sharded actor."""
        exact = (
            value_target is not None
            and value_target.needs_score_norms
            and value_target.score_norm == "parameters"
        )
        if exact and isinstance(actor, FSDPModule):
            raise ValueError(
                "value_target optimal_baseline=True needs each row's gradient norm, which is not "
                "supported with ModelParallelStrategy (FSDP2); use strategy 'ddp', "
                "score_norm='logits' or optimal_baseline=False."
            )
        if self.packed is not None:
            return
        self.packed = self.pack_sequences
        models = [m for m in (actor, critic) if m is not None]
        for model in models if self.pack_sequences else ():
            problem = prepare_packing(model)  # runs a probe forward
            if isinstance(model, FSDPModule):
                model.reshard()  # back to shards only, as configure_model left it
            if problem is not None:
                rank_zero_warn(
                    f"pack_sequences=True: the {type(model).__name__} cannot run on packed "
                    f"rows ({problem}); every forward uses padded rows."
                )
                self.packed = False
                break
        for copy_ in copies:
            copy_.config._attn_implementation = actor.config._attn_implementation

    def _is_packed(self) -> bool:
        if self.packed is None:
            raise RuntimeError(
                "Scorer.prepare must run before the first forward (the LightningModule's "
                "configure_model calls it)."
            )
        return self.packed

    def plan(
        self,
        attention_mask: torch.Tensor,
        reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> list[MicroBatch]:
        """Micro-batches of a minibatch's ``[B, T]`` rows; with ``reduce_max`` (the maximum over
        data-parallel ranks) as many as on the rank with the most."""
        plan = plan_micro_batches(
            attention_mask,
            max_rows=self.micro_batch_size,
            max_tokens=self.max_tokens,
            packed=self._is_packed(),
        )
        if reduce_max is not None:
            count = reduce_max(torch.tensor(float(len(plan)), device=attention_mask.device))
            plan = equalize(plan, int(count), attention_mask)
        return plan

    def logprobs(
        self, model: nn.Module, ids: torch.Tensor, attn: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """``[n, w]`` log-probs of one micro-batch's tokens under ``model``."""
        logprobs = packed_token_logprobs if self._is_packed() else token_logprobs
        return logprobs(model, ids, attn, temperature=temperature)[0]

    def values(self, critic: nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """``[n, w]`` critic outputs of one micro-batch."""
        return packed_values(critic, ids, attn) if self._is_packed() else critic(ids, attn)

    def score(
        self, model: nn.Module, batch: RolloutBatch, plan: list[MicroBatch], temperature: float
    ) -> torch.Tensor:
        """``[B, T]`` log-probs of ``batch`` under ``model`` (call without grad)."""

        def logprobs(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
            return self.logprobs(model, ids, attn, temperature)

        return score_rows(logprobs, batch.input_ids, batch.attention_mask, plan)

    def target_inputs(
        self,
        value_target: ValueTarget,
        actor: nn.Module,
        batch: RolloutBatch,
        plan: list[MicroBatch],
        temperature: float,
        weigh: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """The value target's optional inputs that cost forwards: ``score_sq_norms`` (this step's
        ``actor``; :meth:`score_sq_norms`, or :meth:`logit_sq_norms` on ``plan`` when the target's
        ``score_norm`` is ``"logits"``) when ``value_target.needs_score_norms``, else nothing (a
        custom target need not take them)."""
        if not value_target.needs_score_norms:
            return {}
        if value_target.score_norm == "logits":
            return {"score_sq_norms": self.logit_sq_norms(actor, batch, plan, temperature, weigh)}
        return {"score_sq_norms": self.score_sq_norms(actor, batch, temperature, weigh)}

    def score_sq_norms(
        self,
        model: nn.Module,
        batch: RolloutBatch,
        temperature: float,
        weigh: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``[B]`` float64: per row, ‖∇_θ Σ_t weigh(log π_θ(y), mask)_t‖² over ``model``'s
        trainable parameters, the squared norm of the gradient the row gives the actor loss per
        unit of advantage (``weigh``: the loss aggregation's row factor). One forward and one
        ``torch.autograd.grad`` per row, on its own columns (nothing is written to ``.grad``; the
        caller may hold ``torch.no_grad``). A row without actions gets 0."""
        params = [p for p in model.parameters() if p.requires_grad]
        out = torch.zeros(len(batch), dtype=torch.float64, device=batch.input_ids.device)
        with torch.enable_grad():
            for i in range(len(batch)):
                if not bool(batch.mask[i].any()):
                    continue
                real = batch.attention_mask[i].nonzero()
                row = slice(i, i + 1), slice(int(real[0]), int(real[-1]) + 1)
                mask = batch.mask[row]
                logprobs = self.logprobs(
                    model, batch.input_ids[row], batch.attention_mask[row], temperature
                )
                total = weigh(torch.where(mask, logprobs, 0.0), mask).sum()
                grads = torch.autograd.grad(total, params, allow_unused=True)
                # Summed on the device in float64, in parameter order: no host sync per tensor.
                squares = (g.double().square().sum() for g in grads if g is not None)
                out[i] = sum(squares, out.new_zeros(()))
        return out

    def logit_sq_norms(
        self,
        model: nn.Module,
        batch: RolloutBatch,
        plan: list[MicroBatch],
        temperature: float,
        weigh: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``[B]`` float64: per row, Σ_t f_t² ‖e_{y_t} − π_t‖² / τ² over its actions, the squared
        norm of the gradient of the row's ``weigh``-ed log-prob with respect to the logits (f_t
        the row factor, π_t the next-token distribution at temperature τ): the forward-only proxy
        of :meth:`score_sq_norms` that verl's optimal baseline uses. One no-grad forward of
        ``model`` per micro-batch of ``plan``; a row without actions gets 0."""
        norm = packed_token_logit_sq_norms if self._is_packed() else token_logit_sq_norms

        def norms(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
            return norm(model, ids, attn, temperature=temperature)

        per_token = score_rows(norms, batch.input_ids, batch.attention_mask, plan).double()
        factors = weigh(torch.ones_like(per_token), batch.mask)
        return torch.where(batch.mask, factors.square() * per_token, 0.0).sum(dim=1)

    def score_values(
        self, critic: nn.Module | None, batch: RolloutBatch, plan: list[MicroBatch]
    ) -> torch.Tensor:
        """``[B, T]`` critic outputs over ``batch`` (call without grad); zeros, and no forward,
        without a critic (a critic-free value target reads no values)."""
        if critic is None:
            return torch.zeros(batch.input_ids.shape, device=batch.input_ids.device)

        def values(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
            return self.values(critic, ids, attn)

        return score_rows(values, batch.input_ids, batch.attention_mask, plan)
