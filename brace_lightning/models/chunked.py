"""Log-probs and entropy of chosen tokens from final hidden states, a chunk of positions at a time.

Today's full path materialises the logits ``[B, T, V]`` in float32, their log-softmax and, in the
backward pass, their gradient: for one row of 8192 tokens at V = 151,936 that is about 5 GB per
copy. :func:`chunked_head_logprobs` applies the LM head to ``chunk_size`` positions at a time and
keeps only two floats per position (log-prob of the chosen token, entropy). Its backward pass
recomputes each chunk's logits and forms their gradient in closed form, so peak extra memory is a
few ``[chunk_size, V]`` float32 blocks whatever T is:

- ``∂ log p_y / ∂ z_j = 1[j = y] − p_j``
- ``∂ H / ∂ z_j = −p_j (log p_j + H)`` with ``H = −Σ p log p``

where ``z = (h Wᵀ + b) / temperature``. The gradient with respect to the raw logits is then divided
by the temperature and pushed through the linear head (``h`` and ``W`` and ``b``).

:func:`linear_lm_head` decides whether a model can use this path: its output embedding must be a
plain ``nn.Linear`` applied as is (no logit soft-capping or scaling). Then
:func:`final_hidden_states` reads the head's input and the model computes no logits at all.
Otherwise :func:`~brace_lightning.models.policy.token_logprobs` falls back to the full path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

#: Config attributes that, when set, mean the logits are not just the head's output.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def linear_lm_head(model: nn.Module) -> nn.Linear | None:
    """The model's LM head when the chunked path can replace its logits, else None.

    Args:
        model: a Hugging Face causal LM (possibly sharded with FSDP2).

    Returns:
        The ``nn.Linear`` output embedding when the logits are exactly that layer applied to its
        input (no soft-capping or scaling after it, see ``LOGIT_TRANSFORMS``); None otherwise.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:
        return None
    config = getattr(model, "config", None)
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            return None
    return head


def final_hidden_states(model: nn.Module, **inputs: Any) -> torch.Tensor:
    """The ``[B, T, H]`` hidden states a causal LM's head turns into logits, computing no logits.

    The model's own ``forward`` runs (so FSDP2's root hooks and any wrappers apply). A forward
    pre-hook on its head (:func:`linear_lm_head`) records the head's input and hands the head an
    empty slice of it instead, so the head returns ``[B, 0, V]``. Reading the head's input rather
    than the base model's output also covers models whose head input is made outside the base
    model's ``forward`` (OPT runs its decoder directly, and projects to the embedding width).
    """
    head = model.get_output_embeddings()
    captured: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        captured.append(hidden)
        return (hidden[..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(keep)
    try:
        model(**inputs, use_cache=False)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(
            f"final_hidden_states saw the LM head of {type(model).__name__} run "
            f"{len(captured)} times in one forward; expected exactly once."
        )
    return captured[0]


def _full(weight: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter as one plain tensor (FSDP2 keeps the root's parameters sharded between
    forwards; gathering a DTensor is differentiable, so gradients return to the shards)."""
    if isinstance(weight, DTensor):
        return weight.full_tensor()
    return weight


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half, bfloat16 and float32 logits, float64 for float64 (so gradcheck can run)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scaled float32 logits ``z`` of one chunk, their log-normaliser and the chosen log-probs."""
    logits = F.linear(hidden, weight, bias)
    z = logits.to(accumulation_dtype(logits.dtype)) / temperature
    log_z = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, targets[:, None]).squeeze(-1) - log_z
    return z, log_z, picked


class _ChunkedHeadLogProbs(torch.autograd.Function):
    """See :func:`chunked_head_logprobs`; the head is recomputed chunk by chunk in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        dtype = accumulation_dtype(torch.promote_types(hidden.dtype, weight.dtype))
        logprobs = hidden.new_zeros(n, dtype=dtype)
        entropy = hidden.new_zeros(n, dtype=dtype)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            z, log_z, picked = _chunk_stats(hidden[rows], weight, bias, targets[rows], temperature)
            logprobs[rows] = picked
            if with_entropy:
                entropy[rows] = log_z - (torch.softmax(z, dim=-1) * z).sum(-1)
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        return logprobs, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        temperature: float = ctx.temperature
        use_entropy = ctx.with_entropy and grad_entropy is not None
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if want_h else None
        dtype = accumulation_dtype(weight.dtype)
        grad_w = torch.zeros_like(weight, dtype=dtype) if want_w else None
        grad_b = torch.zeros_like(bias, dtype=dtype) if want_b and bias is not None else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]
            z, log_z, _ = _chunk_stats(h, weight, bias, targets[rows], temperature)
            log_p = z - log_z[:, None]
            del z
            p = log_p.exp()
            grad_z = torch.zeros_like(p)
            if grad_logprobs is not None:
                g = grad_logprobs[rows].to(p.dtype)
                grad_z -= p * g[:, None]
                grad_z.scatter_add_(-1, targets[rows, None], g[:, None])
            if use_entropy:
                g = grad_entropy[rows].to(p.dtype)
                grad_z -= p * (log_p + entropy[rows, None]) * g[:, None]
            del p, log_p
            grad_z /= temperature
            grad_logits = grad_z.to(weight.dtype)
            if grad_h is not None:
                grad_h[rows] = (grad_logits @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(grad_z.t(), h.to(dtype))  # in place: no [V, H] temporary
            if grad_b is not None:
                grad_b += grad_z.sum(0)
            del grad_z, grad_logits
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def chunked_head_logprobs(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(head(hidden) / temperature)[targets]`` (and the entropy) without ``[N, V]``.

    Args:
        hidden: ``[N, H]`` final hidden states of the positions that predict ``targets``.
        head: the LM head (``nn.Linear(H, V)``, possibly FSDP2-sharded).
        targets: ``[N]`` long, the chosen token of every position.
        temperature: divides the logits; must be > 0.
        chunk_size: positions per chunk (peak extra memory is a few ``[chunk_size, V]`` float32).
        return_entropy: also return the entropy of every position's distribution.

    Returns:
        ``(logprobs, entropy)``, both ``[N]`` float32 (float64 for float64 inputs); ``entropy`` is
        None unless requested.
    """
    if not temperature > 0:
        raise ValueError(f"chunked_head_logprobs got temperature={temperature}; expected > 0.")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunked_head_logprobs got chunk_size={chunk_size!r}; expected an integer >= 1."
        )
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_head_logprobs got targets of shape {tuple(targets.shape)}; expected [N] "
            f"matching hidden's {tuple(hidden.shape)} ([N, H])."
        )
    weight, bias = _full(head.weight), _full(head.bias)
    logprobs, entropy = _ChunkedHeadLogProbs.apply(
        hidden, weight, bias, targets, float(temperature), chunk_size, return_entropy
    )
    return logprobs, entropy if return_entropy else None


def logit_sq_norms(log_p: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """``‖∂ log p_y / ∂ l‖²`` per position, ``l`` the raw logits and ``p = softmax(l / temperature)``
    (``log_p`` ``[..., V]``, ``targets`` ``[...]``): ``‖e_y − p‖² / temperature²``, formed as
    ``(1 − p_y)² + Σ_{v≠y} p_v²`` so that it keeps its precision as ``p_y → 1``. Summed over a
    response it is the logit-gradient proxy of ``‖∇_θ log π(y)‖²`` (verl's ``1 − 2π_t + Σπ²``)."""
    picked = log_p.gather(-1, targets[..., None])
    others = log_p.exp().scatter(-1, targets[..., None], 0.0)
    return (torch.expm1(picked[..., 0]).square() + others.square().sum(-1)) / temperature**2


def chunked_head_logit_sq_norms(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """:func:`logit_sq_norms` of ``head(hidden)`` at ``targets`` (``[N]`` float32, float64 for
    float64 inputs), ``chunk_size`` positions at a time and without a graph (the arguments are
    :func:`chunked_head_logprobs`')."""
    weight, bias = _full(head.weight), _full(head.bias)
    out = hidden.new_zeros(
        hidden.shape[0], dtype=accumulation_dtype(torch.promote_types(hidden.dtype, weight.dtype))
    )
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z, log_z, _ = _chunk_stats(hidden[rows], weight, bias, targets[rows], temperature)
            out[rows] = logit_sq_norms(z - log_z[:, None], targets[rows], temperature)
    return out
