"""Value-target kernels: PPO-GAE (λ-return), V-trace and BRACE over token-level ``[B, T]`` tensors.

Conventions (``docs/conventions.md``): ``mask[b, t]`` is True where column t is an action. The next
state of action t is the next action of the same row; columns between two actions (tool output,
prompt, padding) are environment transitions and are skipped, so γ, λ and the cap k count action
steps only. After a row's last action the value is 0. Anything at non-action columns is ignored.

How it is computed. Each row's actions are first packed to the left (``[B, L]``, L = the most
actions in any row), where all three estimators are the same first-order linear recurrence run
backwards in time,

    x_s = b_s + a_s · x_{s+1},

summed either to the end of the row (GAE, V-trace, the BRACE tail) or over a window of k steps
(the BRACE correction window). One routine, :func:`windowed_scan`, computes both by doubling
(Hillis–Steele): windows of length 2^m are composed from two of length 2^(m−1), and a window of
length k from the binary digits of k. Cost O(B·L·log min(k, L)) with O(B·L) extra memory, no loop
over time steps and no ``(B, T, k)`` intermediate. Every weight product it forms spans at most
min(k, L) factors, which is why BRACE stays finite where long V-trace products overflow. When a
product does overflow (λ·c̄ > 1 with no cap or a cap in the thousands), the kernels raise one
ValueError naming the remedy instead of returning the NaN that inf − inf leaves behind.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from brace_lightning.checks import require_bool

__all__ = [
    "ValueTargets",
    "brace",
    "check_discount",
    "check_truncation",
    "check_cap",
    "check_log_budget",
    "gae",
    "rho_scaled",
    "vtrace",
    "budget_windows",
    "variable_window_scan",
    "windowed_scan",
]


class ValueTargets(NamedTuple):
    """Output of every value-target kernel, both ``[B, T]`` in the input dtype, 0 at non-actions.

    ``advantages`` feed the actor objective; ``returns`` are the critic's regression target.
    """

    advantages: torch.Tensor
    returns: torch.Tensor


# --------------------------------------------------------------------------- validation


def check_discount(name: str, value: float) -> None:
    """Raise ValueError unless ``value`` (γ or λ) is a number in [0, 1]."""
    if not isinstance(value, int | float) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1]; got {value!r}.")


def check_truncation(rho_bar: float, c_bar: float) -> None:
    """Raise ValueError unless 0 < c̄ ≤ ρ̄ < ∞ (the truncation levels of the importance weights)."""
    for name, value in (("rho_bar", rho_bar), ("c_bar", c_bar)):
        if not isinstance(value, int | float) or not 0.0 < float(value) < math.inf:
            raise ValueError(f"{name} must be a positive finite number; got {value!r}.")
    if c_bar > rho_bar:
        raise ValueError(f"c_bar must not exceed rho_bar={rho_bar!r}; got c_bar={c_bar!r}.")


def check_cap(k: int | None) -> None:
    """Raise ValueError unless the correction cap ``k`` is an int ≥ 0 (or None for no cap)."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"k must be an integer >= 0 or None (no cap); got {k!r}.")


def check_log_budget(log_budget: float | None) -> None:
    """Raise ValueError unless ``log_budget`` is a finite number ≥ 0 (or None for no budget)."""
    if log_budget is not None and (
        isinstance(log_budget, bool)
        or not isinstance(log_budget, int | float)
        or not 0.0 <= float(log_budget) < math.inf
    ):
        raise ValueError(
            f"log_budget must be a finite number >= 0 or None (no budget); got {log_budget!r}."
        )


def _check_inputs(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a torch.bool tensor (True at actions); got {what}.")
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape [B, T]; got {tuple(mask.shape)}.")
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must be a floating-point tensor; got {what}.")
        if tensor.shape != mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}; expected {tuple(mask.shape)} like mask."
            )
        if tensor.device != mask.device:
            raise ValueError(f"{name} is on {tensor.device}; expected {mask.device} like mask.")


# --------------------------------------------------------------------------- packing


class _Packed(NamedTuple):
    dest: torch.Tensor  # [B, T] column of each action in the packed layout, L at non-actions
    valid: torch.Tensor  # [B, L] True at packed actions
    length: int  # L


def _pack_layout(mask: torch.Tensor) -> _Packed:
    count = mask.sum(dim=1)
    length = int(count.max()) if mask.numel() else 0
    dest = torch.where(
        mask, mask.long().cumsum(dim=1) - 1, torch.full_like(mask, length, dtype=torch.long)
    )
    valid = torch.arange(length, device=mask.device) < count.unsqueeze(1)
    return _Packed(dest, valid, length)


def _pack(name: str, x: torch.Tensor, layout: _Packed, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T]`` → ``[B, L]``: each row's action values moved left, 0 after the row's actions.

    Raises ValueError naming ``name`` if an action value is not finite (non-actions are dropped
    here, so garbage there never reaches the arithmetic)."""
    out = torch.zeros(x.shape[0], layout.length + 1, dtype=dtype, device=x.device)
    out.scatter_(1, layout.dest, x.to(dtype))
    out = out[:, : layout.length]
    # One reduction first; the elementwise check runs only when the sum is not finite.
    if not bool(torch.isfinite(out.sum())) and not bool(torch.isfinite(out).all()):
        raise ValueError(f"{name} has non-finite values at action positions; expected finite.")
    return out


def _unpack(x: torch.Tensor, layout: _Packed, dtype: torch.dtype) -> torch.Tensor:
    """``[B, L]`` → ``[B, T]``: inverse of :func:`_pack`, 0 at non-actions."""
    padded = torch.nn.functional.pad(x, (0, 1))
    return padded.gather(1, layout.dest).to(dtype)


def _shift(x: torch.Tensor, n: int, fill: float) -> torch.Tensor:
    """``y[:, s] = x[:, s + n]``, ``fill`` past the end."""
    if n >= x.shape[1]:
        return torch.full_like(x, fill)
    return torch.nn.functional.pad(x[:, n:], (0, n), value=fill)


# --------------------------------------------------------------------------- the scan


def _compose(
    x_head: torch.Tensor,
    p_head: torch.Tensor,
    x_tail: torch.Tensor,
    p_tail: torch.Tensor | None,
    span: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Window [s, s + span) (``head``) followed by the window starting at s + span (``tail``):
    x = x_head + p_head · x_tail[s + span], p = p_head · p_tail[s + span]; past the end the tail
    is the empty window (x = 0, p = 1), so those columns keep the head unchanged."""
    keep = max(x_head.shape[1] - span, 0)
    x = torch.empty_like(x_head)
    torch.addcmul(x_head[:, :keep], p_head[:, :keep], x_tail[:, span:], out=x[:, :keep])
    x[:, keep:] = x_head[:, keep:]
    if p_tail is None:
        return x, None
    p = torch.empty_like(p_head)
    torch.mul(p_head[:, :keep], p_tail[:, span:], out=p[:, :keep])
    p[:, keep:] = p_head[:, keep:]
    return x, p


def windowed_scan(
    a: torch.Tensor, b: torch.Tensor, window: int | None = None, *, with_products: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Windowed backward linear recurrence over packed rows, by doubling.

    For every s, with n = L (pad rows with ``a = 1, b = 0`` past their end):

        x_s = Σ_{t=s}^{j−1} (Π_{i=s}^{t−1} a_i) b_t,    p_s = Π_{i=s}^{j−1} a_i,    j = min(s + window, n).

    ``window=None`` (or ≥ L) sums to the end of the row: x_s = b_s + a_s x_{s+1}.

    Args:
        a: ``[B, L]`` per-step decay (γλ for GAE, γ·c_i for V-trace and BRACE).
        b: ``[B, L]`` per-step increment (δ, ρδ, or the reward).
        window: number of steps summed from each s; None for no limit.
        with_products: also return p (else None), which costs one multiply per level.

    Returns:
        ``(x, p)``, both ``[B, L]``.
    """
    length = a.shape[1]
    remaining = length if window is None else min(window, length)
    if remaining == 0:
        return torch.zeros_like(b), torch.ones_like(a) if with_products else None
    x_acc: torch.Tensor | None = None  # the window of the binary digits of `window` seen so far
    p_acc: torch.Tensor | None = None
    x_m, p_m, span = b, a, 1  # windows of length `span` starting at each s
    while remaining:
        if remaining & 1:
            if x_acc is None:
                x_acc, p_acc = x_m, p_m if with_products else None
            else:
                x_acc, p_acc = _compose(x_m, p_m, x_acc, p_acc, span)
        remaining >>= 1
        if remaining:
            x_m, p_m = _compose(x_m, p_m, x_m, p_m, span)
            span *= 2
    assert x_acc is not None
    return x_acc, p_acc


def budget_windows(log_c: torch.Tensor, log_budget: float, cap: int) -> torch.Tensor:
    """Per start s, the most steps n ≤ ``cap`` whose trace products all stay within the budget:

        n(s) = max{n ≤ cap : |Σ_{i=s}^{s+m−1} log c_i| ≤ log_budget for every m = 1..n}.

    Found by binary lifting over range maxima and minima of the prefix sums of ``log c`` (no loop
    over time steps): O(B·L·log cap) time and memory.

    Args:
        log_c: ``[B, L]`` log trace weights (0 past each row's end, so a window never ends there).
        log_budget: the budget, ≥ 0.
        cap: the largest window, ≥ 0.

    Returns:
        ``[B, L]`` int64 window lengths.
    """
    batch, length = log_c.shape
    n = torch.zeros(batch, length, dtype=torch.long, device=log_c.device)
    if cap == 0 or length == 0:
        return n
    # A window's partial sum is within ±budget before each step, so a factor whose log is beyond
    # ±(2·budget) ends every window that reaches it: clamping there keeps the decisions exact and
    # keeps log 0 = −inf out of the prefix sums (no inf − inf).
    bound = 2.0 * log_budget + 1.0
    step = log_c.to(torch.float64).clamp(-bound, bound)
    prefix = torch.nn.functional.pad(step.cumsum(1), (1, 0))  # prefix[:, t] = Σ_{i<t} log c_i
    top = cap.bit_length() - 1
    # Range tables over prefix[q .. q + 2^j − 1]; padded past the end with the last prefix sum.
    width = length + 1 + (1 << (top + 1))
    padded = torch.cat([prefix, prefix[:, -1:].expand(batch, width - length - 1)], dim=1)
    highs, lows = [padded], [padded]
    for j in range(1, top + 1):
        half = 1 << (j - 1)
        highs.append(torch.maximum(highs[-1], _shift(highs[-1], half, -math.inf)))
        lows.append(torch.minimum(lows[-1], _shift(lows[-1], half, math.inf)))
    start = prefix[:, :length]
    position = torch.arange(1, length + 1, device=log_c.device).expand(batch, length).clone()
    for j in range(top, -1, -1):
        size = 1 << j
        high = highs[j].gather(1, position)
        low = lows[j].gather(1, position)
        grow = (n + size <= cap) & (high - start <= log_budget) & (start - low <= log_budget)
        n += grow * size
        position += grow * size
    return n


def variable_window_scan(
    a: torch.Tensor, b: torch.Tensor, n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`windowed_scan` with a window length of its own for every start s, ``n[:, s]``:

        x_s = Σ_{t=s}^{s+n_s−1} (Π_{i=s}^{t−1} a_i) b_t,    p_s = Π_{i=s}^{s+n_s−1} a_i.

    The windows of length 2^j starting at every column are built by doubling, as in
    :func:`windowed_scan`, and each start composes the ones of its binary digits by gathering them.
    Memory O(B·L·log max n).

    Args:
        a, b: ``[B, L]`` decay and increment (rows padded with ``a = 1, b = 0`` past their end).
        n: ``[B, L]`` int64 window lengths ≥ 0.

    Returns:
        ``(x, p)``, both ``[B, L]``.
    """
    batch, length = a.shape
    x = torch.zeros_like(b)
    p = torch.ones_like(a)
    longest = int(n.max()) if n.numel() else 0
    if longest == 0:
        return x, p
    tables = [(b, a)]  # windows of length 2^j starting at every column
    for j in range(1, longest.bit_length()):
        x_m, p_m = tables[-1]
        composed = _compose(x_m, p_m, x_m, p_m, 1 << (j - 1))
        assert composed[1] is not None
        tables.append((composed[0], composed[1]))
    position = torch.arange(length, device=a.device).expand(batch, length).clone()
    for j in range(len(tables) - 1, -1, -1):
        take = ((n >> j) & 1) == 1
        inside = take & (position < length)  # a window past the end of the row is empty
        index = position.clamp(max=length - 1)
        x_piece = torch.where(inside, tables[j][0].gather(1, index), 0.0)
        p_piece = torch.where(inside, tables[j][1].gather(1, index), 1.0)
        x = x + p * x_piece
        p = p * p_piece
        position += take * (1 << j)
    return x, p


# --------------------------------------------------------------------------- estimators


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision sums over thousands of steps lose the reward; accumulate in float32 at least.
    return torch.promote_types(dtype, torch.float32)


def _per_step(valid: torch.Tensor, factor: float, dtype: torch.dtype) -> torch.Tensor:
    """``factor`` at packed actions, 1 past each row's end (so products stop at the row's end)."""
    one = torch.ones((), dtype=dtype, device=valid.device)
    return torch.where(valid, one * factor, one)


def _discounted_sum(b: torch.Tensor, factor: float, valid: torch.Tensor) -> torch.Tensor:
    """Σ_{t≥s} factor^(t−s) b_t along packed rows (``b`` is 0 past each row's end)."""
    if factor == 1.0:  # the paper's γ = λ = 1: a reverse cumulative sum, no scan needed
        return b.flip(1).cumsum(1).flip(1)
    x, _ = windowed_scan(_per_step(valid, factor, b.dtype), b, with_products=False)
    return x


def _truncated_weight(log_ratio: torch.Tensor, bar: float) -> torch.Tensor:
    """min(bar, exp(log_ratio)) without overflowing for large log-ratios."""
    return torch.exp(torch.clamp(log_ratio, max=math.log(bar)))


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lmbda: float = 1.0,
) -> ValueTargets:
    """Generalized advantage estimation (Schulman et al. 2016) over action steps.

    δ_t = r_t + γ V(next) − V(t);  A_s = Σ_{t≥s} (γλ)^(n_t − n_s) δ_t;  returns = A + V.

    Args:
        rewards, values: ``[B, T]`` floating point; only action columns are read.
        mask: ``[B, T]`` bool, True at actions.
        gamma, lmbda: discount and GAE λ in [0, 1], counted in action steps.
    """
    check_discount("gamma", gamma)
    check_discount("lmbda", lmbda)
    _check_inputs(mask, rewards=rewards, values=values)
    layout = _pack_layout(mask)
    work = _work_dtype(values.dtype)
    r, v = _pack("rewards", rewards, layout, work), _pack("values", values, layout, work)
    delta = r + gamma * _shift(v, 1, 0.0) - v
    adv = _discounted_sum(delta, gamma * lmbda, layout.valid)
    return ValueTargets(_unpack(adv, layout, values.dtype), _unpack(adv + v, layout, values.dtype))


def rho_scaled(
    advantages: torch.Tensor,
    target_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    rho_bar: float,
) -> torch.Tensor:
    """The actor's advantage times ρ_s = min(ρ̄, π(y_s)/µ(y_s)), V-trace's policy-gradient factor.

    For a target that has no such factor of its own (GAE): ``GAE(rho_in_advantage=True)`` scales
    its advantage as ``VTrace`` does and ``BRACE(rho_in_advantage=True)`` does, so the actor-side
    factor can be studied apart from the critic's target (docs/stability.md).

    Args:
        advantages, target_logprobs, behavior_logprobs: ``[B, T]`` floating point.
        mask: ``[B, T]`` bool, True at actions.
        rho_bar: the truncation ρ̄ > 0.

    Returns:
        ``[B, T]`` ρ ⊙ advantages in the advantages' dtype, 0 at non-actions.
    """
    _check_inputs(
        mask,
        advantages=advantages,
        target_logprobs=target_logprobs,
        behavior_logprobs=behavior_logprobs,
    )
    work = _work_dtype(advantages.dtype)
    log_w = target_logprobs.to(work) - behavior_logprobs.to(work)
    scaled = _truncated_weight(torch.where(mask, log_w, 0.0), rho_bar) * advantages.to(work)
    return torch.where(mask, scaled, 0.0).to(advantages.dtype)


def _check_products_finite(
    target: torch.Tensor, *, lmbda: float, c_bar: float, k: int | None, length: int
) -> None:
    """Raise ValueError if the packed targets are not finite (inputs were checked finite, so the
    weight products overflowed: inf − inf and inf · 0 inside the scan turn them into NaN)."""
    if bool(torch.isfinite(target.sum())) or bool(torch.isfinite(target).all()):
        return
    factors = length if k is None else min(k, length)
    raise ValueError(
        f"the importance-weight products overflowed {target.dtype}: with lmbda*c_bar = "
        f"{lmbda * c_bar:g} > 1 a product of up to {factors} factors (k={k!r}) exceeds the largest "
        "number; cap the products with BRACE's k (e.g. k=100) or use lmbda*c_bar <= 1."
        if lmbda * c_bar > 1.0
        else f"the value targets overflowed {target.dtype} (inputs too large for this dtype); "
        "rescale the rewards or values."
    )


def _corrected_targets(
    rewards: torch.Tensor,
    values: torch.Tensor,
    target_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lmbda: float,
    rho_bar: float,
    c_bar: float,
    k: int | None,
    mc_tail: bool,
    rho_in_advantage: bool,
    log_budget: float | None = None,
) -> ValueTargets:
    """Shared body of :func:`vtrace` (k=None) and :func:`brace`; see their docstrings."""
    check_discount("gamma", gamma)
    check_discount("lmbda", lmbda)
    check_truncation(rho_bar, c_bar)
    check_cap(k)
    check_log_budget(log_budget)
    _check_inputs(
        mask,
        rewards=rewards,
        values=values,
        target_logprobs=target_logprobs,
        behavior_logprobs=behavior_logprobs,
    )
    layout = _pack_layout(mask)
    work = _work_dtype(values.dtype)
    r, v = _pack("rewards", rewards, layout, work), _pack("values", values, layout, work)
    log_w = _pack("target_logprobs", target_logprobs, layout, work) - _pack(
        "behavior_logprobs", behavior_logprobs, layout, work
    )
    rho = _truncated_weight(log_w, rho_bar)
    c = lmbda * _truncated_weight(log_w, c_bar)

    delta = r + gamma * _shift(v, 1, 0.0) - v
    decay = torch.where(layout.valid, gamma * c, 1.0)
    cap = layout.length if k is None else min(k, layout.length)
    window: torch.Tensor | None = None
    if log_budget is not None:
        log_c = torch.where(layout.valid, torch.log(c), 0.0)
        window = budget_windows(log_c, float(log_budget), cap)
        correction, path_weight = variable_window_scan(decay, rho * delta, window)
    else:
        capped = cap < layout.length
        correction, path_weight = windowed_scan(decay, rho * delta, k, with_products=capped)
    target = v + correction
    if path_weight is not None:
        # Residuals past the window j = s + n all carry the frozen weight Π(s) (path_weight holds
        # γ^n Π(s)). With u_t = 1 they telescope to the discounted return-to-go G_j minus V_j,
        # which is how we compute them: exact telescoping, no alternating-sign noise.
        if mc_tail:
            tail = _discounted_sum(r, gamma, layout.valid) - v
        else:
            tail = _discounted_sum(rho * delta, gamma, layout.valid)
        if window is None:
            target = target + path_weight * _shift(tail, cap, 0.0)
        else:
            after = torch.arange(layout.length, device=tail.device) + window
            padded_tail = torch.nn.functional.pad(tail, (0, 1))
            tail_at = padded_tail.gather(1, after.clamp(max=layout.length))
            target = target + path_weight * tail_at

    target = torch.where(layout.valid, target, 0.0)
    _check_products_finite(target, lmbda=lmbda, c_bar=c_bar, k=k, length=layout.length)
    advantage = r + gamma * _shift(target, 1, 0.0) - v
    if rho_in_advantage:
        advantage = rho * advantage
    return ValueTargets(
        _unpack(advantage, layout, values.dtype), _unpack(target, layout, values.dtype)
    )


def vtrace(
    rewards: torch.Tensor,
    values: torch.Tensor,
    target_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lmbda: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    rho_in_advantage: bool = True,
) -> ValueTargets:
    """V-trace (Espeholt et al. 2018, eq. 1) with λ, over action steps.

    w = π/µ, ρ_t = min(ρ̄, w_t), c_i = λ·min(c̄, w_i), δ_t = r_t + γ V(next) − V(t):

        v_s = V_s + Σ_{t≥s} γ^(t−s) (Π_{i=s}^{t−1} c_i) ρ_t δ_t;   A_s = ρ_s (r_s + γ v_{s+1} − V_s).

    With λ·c̄ > 1 the weight products grow without bound along long rows; they are not clipped here
    (that failure is what BRACE's cap removes). When they overflow the dtype this raises ValueError
    naming the remedy (a cap k, or λ·c̄ ≤ 1) instead of returning NaN.

    Args:
        rewards, values: ``[B, T]``; only action columns are read.
        target_logprobs: ``[B, T]`` log π of the taken tokens (the trainer's policy).
        behavior_logprobs: ``[B, T]`` log µ recorded by the engine.
        mask: ``[B, T]`` bool, True at actions.
        gamma, lmbda: in [0, 1].  rho_bar, c_bar: truncation levels, 0 < c̄ ≤ ρ̄.
        rho_in_advantage: scale the advantage by ρ_s (IMPALA's policy-gradient advantage, default);
            False leaves the actor-side correction to the actor objective, as BRACE does.
    """
    require_bool("rho_in_advantage", rho_in_advantage)
    return _corrected_targets(
        rewards,
        values,
        target_logprobs,
        behavior_logprobs,
        mask,
        gamma=gamma,
        lmbda=lmbda,
        rho_bar=rho_bar,
        c_bar=c_bar,
        k=None,
        mc_tail=False,
        rho_in_advantage=rho_in_advantage,
    )


def brace(
    rewards: torch.Tensor,
    values: torch.Tensor,
    target_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lmbda: float = 1.0,
    rho_bar: float = 1.2,
    c_bar: float = 1.1,
    k: int | None = 100,
    mc_tail: bool = True,
    log_budget: float | None = None,
    rho_in_advantage: bool = False,
) -> ValueTargets:
    """BRACE: k-capped importance-weighted Bellman residuals plus an anchored Monte-Carlo tail.

    With j = min(s + k, end + 1) in action steps and Π_k(s) = Π_{i=s}^{j−1} c_i (paper §4.1–4.2):

        v_s = V_s + Σ_{t=s}^{j−1} γ^(t−s) (Π_{i=s}^{t−1} c_i) ρ_t δ_t + Π_k(s) Σ_{t=j}^{end} γ^(t−s) u_t δ_t,

    u_t = 1 (Monte-Carlo tail, which telescopes to Π_k(s)[γ^(end−s) R − γ^(j−s) V_j] for a terminal
    reward) or u_t = ρ_t (``mc_tail=False``, the paper's ablation). Advantage Â_s = r_s + γ v_{s+1} − V_s.
    k = 0 gives the discounted Monte-Carlo return, k ≥ row length (or None) gives V-trace's target.

    Args:
        rewards, values: ``[B, T]``; only action columns are read.
        target_logprobs: ``[B, T]`` log π of the taken tokens (the trainer's policy).
        behavior_logprobs: ``[B, T]`` log µ recorded by the engine.
        mask: ``[B, T]`` bool, True at actions.
        gamma, lmbda: in [0, 1].  rho_bar, c_bar: truncation levels, 0 < c̄ ≤ ρ̄.
        k: cap on the number of importance factors in any product (int ≥ 0; None = no cap).
        mc_tail: weight the residuals past the cap by 1 (True) or by ρ_t (False).
        log_budget: also end each window, before k, at the last step whose trace products all
            stay within ``exp(±log_budget)``: the window from s holds the most steps n ≤ k with
            |log Π_{i=s}^{s+m−1} c_i| ≤ log_budget for every m ≤ n, so the cap adapts to how fast
            the truncated products drift (fast drift: short windows, more Monte-Carlo tail; no
            drift: up to k). ``c_i`` includes λ. None (default): the fixed cap k only (the paper).
        rho_in_advantage: scale the advantage by ρ_s = min(ρ̄, w_s) as V-trace does (not in the
            paper, whose actor-side correction is the actor objective's; default False). With
            k = None it makes BRACE V-trace in both outputs.
    """
    require_bool("rho_in_advantage", rho_in_advantage)
    return _corrected_targets(
        rewards,
        values,
        target_logprobs,
        behavior_logprobs,
        mask,
        gamma=gamma,
        lmbda=lmbda,
        rho_bar=rho_bar,
        c_bar=c_bar,
        k=k,
        mc_tail=mc_tail,
        rho_in_advantage=rho_in_advantage,
        log_budget=log_budget,
    )
