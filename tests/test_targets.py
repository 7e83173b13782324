"""Value-target kernels against the float64 reference and the identities of docs/conventions.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from brace_lightning.targets.functional import brace, gae, vtrace
from tests.support.reference_targets import reference_targets


def layout_mask(T: int = 24) -> torch.Tensor:
    """Rows: left padding, right padding, tool-output holes, no action, one action, all actions."""
    mask = torch.zeros(6, T, dtype=torch.bool)
    mask[0, 7:] = True
    mask[1, 3 : T - 6] = True
    mask[2, 2:8] = True
    mask[2, 11:15] = True
    mask[2, 18 : T - 1] = True
    mask[4, 5] = True
    mask[5, :] = True
    return mask


def random_inputs(mask: torch.Tensor, seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    shape = mask.shape
    rewards = torch.randn(shape, generator=g, dtype=torch.float64) * 0.1
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    target = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    behavior = target + torch.randn(shape, generator=g, dtype=torch.float64) * scale
    return rewards, values, target, behavior


def run(kind, rewards, values, target, behavior, mask, **kw):
    if kind == "gae":
        return gae(rewards, values, mask, **kw)
    if kind == "vtrace":
        return vtrace(rewards, values, target, behavior, mask, **kw)
    return brace(rewards, values, target, behavior, mask, **kw)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol)


CLIPS = [(1.0, 1.0), (1.2, 1.1), (2.0, 1.5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma", [1.0, 0.99])
@pytest.mark.parametrize("lmbda", [1.0, 0.95])
def test_gae_matches_reference(dtype, gamma, lmbda):
    mask = layout_mask()
    rewards, values, _, _ = random_inputs(mask)
    out = gae(rewards.to(dtype), values.to(dtype), mask, gamma=gamma, lmbda=lmbda)
    ref_adv, ref_ret = reference_targets("gae", rewards, values, mask, gamma=gamma, lmbda=lmbda)
    assert out.advantages.dtype == dtype and out.returns.dtype == dtype
    assert_close(out.advantages, ref_adv, dtype)
    assert_close(out.returns, ref_ret, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma", [1.0, 0.99])
@pytest.mark.parametrize("lmbda", [1.0, 0.95])
@pytest.mark.parametrize("clips", CLIPS)
def test_vtrace_matches_reference(dtype, gamma, lmbda, clips):
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=1)
    rho_bar, c_bar = clips
    kw = dict(gamma=gamma, lmbda=lmbda, rho_bar=rho_bar, c_bar=c_bar)
    out = vtrace(*(x.to(dtype) for x in (rewards, values, target, behavior)), mask, **kw)
    ref_adv, ref_ret = reference_targets("vtrace", rewards, values, mask, target, behavior, **kw)
    assert_close(out.advantages, ref_adv, dtype)
    assert_close(out.returns, ref_ret, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma", [1.0, 0.99])
@pytest.mark.parametrize("lmbda", [1.0, 0.95])
@pytest.mark.parametrize("clips", CLIPS)
@pytest.mark.parametrize("k", [0, 1, 7, 100, 24, None])
@pytest.mark.parametrize("mc_tail", [True, False])
def test_brace_matches_reference(dtype, gamma, lmbda, clips, k, mc_tail):
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=2)
    rho_bar, c_bar = clips
    kw = dict(gamma=gamma, lmbda=lmbda, rho_bar=rho_bar, c_bar=c_bar, k=k, mc_tail=mc_tail)
    out = brace(*(x.to(dtype) for x in (rewards, values, target, behavior)), mask, **kw)
    ref_adv, ref_ret = reference_targets("brace", rewards, values, mask, target, behavior, **kw)
    assert_close(out.advantages, ref_adv, dtype)
    assert_close(out.returns, ref_ret, dtype)


@pytest.mark.parametrize("k", [1, 37, 100, None])
@pytest.mark.parametrize("mc_tail", [True, False])
@pytest.mark.parametrize("log_budget", [None, 0.2, 1.0, 4.0])
def test_brace_matches_reference_on_rows_longer_than_the_cap(k, mc_tail, log_budget):
    mask = torch.ones(2, 160, dtype=torch.bool)
    mask[1, :30] = False  # a long prompt
    mask[1, 90:95] = False  # a tool output
    rewards, values, target, behavior = random_inputs(mask, seed=3, scale=0.3)
    kw = dict(gamma=0.999, lmbda=1.0, rho_bar=1.2, c_bar=1.1, k=k, mc_tail=mc_tail)
    kw["log_budget"] = log_budget  # None: the paper's fixed cap; else docs/conventions.md
    out = brace(rewards, values, target, behavior, mask, **kw)
    ref_adv, ref_ret = reference_targets("brace", rewards, values, mask, target, behavior, **kw)
    assert_close(out.returns, ref_ret, torch.float64)
    assert_close(out.advantages, ref_adv, torch.float64)


# ----------------------------------------------------------------------------- identities


def discounted_return_to_go(rewards, mask, gamma):
    out = torch.zeros_like(rewards)
    for b in range(mask.shape[0]):
        running = 0.0
        for t in reversed(range(mask.shape[1])):
            if mask[b, t]:
                running = float(rewards[b, t]) + gamma * running
                out[b, t] = running
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.97])
def test_brace_k0_is_discounted_monte_carlo_return(gamma):
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=4, scale=2.0)
    out = brace(rewards, values, target, behavior, mask, gamma=gamma, k=0)
    torch.testing.assert_close(out.returns, discounted_return_to_go(rewards, mask, gamma))


@pytest.mark.parametrize("k", [24, 1000, None])
def test_brace_with_cap_beyond_length_is_vtrace(k):
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=5)
    kw = dict(gamma=0.99, lmbda=0.95, rho_bar=1.2, c_bar=1.1)
    ours = brace(rewards, values, target, behavior, mask, k=k, **kw)
    theirs = vtrace(rewards, values, target, behavior, mask, **kw)
    torch.testing.assert_close(ours.returns, theirs.returns)


def test_brace_on_policy_undiscounted_target_is_the_return():
    mask = layout_mask()
    rewards, values, target, _ = random_inputs(mask, seed=6)
    rewards = torch.where(mask, 0.0, rewards)  # garbage only outside actions
    last = mask.long().cumsum(1) == mask.sum(1, keepdim=True)
    terminal = last & mask & (mask.long().cumsum(1) > 0)
    R = torch.randn(mask.shape[0], 1, dtype=torch.float64)
    rewards = torch.where(terminal, R, rewards)
    for k in (0, 1, 5, 100):
        out = brace(rewards, values, target, target, mask, k=k, rho_bar=1.2, c_bar=1.1)
        expected = torch.where(mask, R.expand_as(mask), 0.0)
        torch.testing.assert_close(out.returns, expected)


@pytest.mark.parametrize("lmbda", [1.0, 0.9])
def test_on_policy_vtrace_equals_gae_returns(lmbda):
    mask = layout_mask()
    rewards, values, target, _ = random_inputs(mask, seed=7)
    v = vtrace(rewards, values, target, target, mask, gamma=0.98, lmbda=lmbda)
    g = gae(rewards, values, mask, gamma=0.98, lmbda=lmbda)
    torch.testing.assert_close(v.returns, g.returns)
    if lmbda == 1.0:  # then r_s + γ v_{s+1} − V_s telescopes to the GAE advantage
        torch.testing.assert_close(v.advantages, g.advantages)
    else:
        assert not torch.allclose(v.advantages, g.advantages)


@pytest.mark.parametrize("kind", ["gae", "vtrace", "brace"])
def test_garbage_at_non_actions_changes_nothing(kind):
    mask = layout_mask()
    inputs = random_inputs(mask, seed=8)
    clean = run(kind, *inputs, mask, k=5) if kind == "brace" else run(kind, *inputs, mask)
    dirty_inputs = []
    for i, x in enumerate(inputs):
        garbage = torch.tensor([math.nan, math.inf, -math.inf, 1e30][i], dtype=x.dtype)
        dirty_inputs.append(torch.where(mask, x, garbage))
    dirty = (
        run(kind, *dirty_inputs, mask, k=5) if kind == "brace" else run(kind, *dirty_inputs, mask)
    )
    for a, b in zip(clean, dirty, strict=True):
        torch.testing.assert_close(a, b)
        assert bool((b[~mask] == 0).all())


@pytest.mark.parametrize("kind", ["gae", "vtrace", "brace"])
def test_rows_are_independent(kind):
    mask = layout_mask()
    inputs = random_inputs(mask, seed=9)
    kw = {"k": 3} if kind == "brace" else {}
    whole = run(kind, *inputs, mask, **kw)
    for b in range(mask.shape[0]):
        row = run(kind, *(x[b : b + 1] for x in inputs), mask[b : b + 1], **kw)
        torch.testing.assert_close(row.returns[0], whole.returns[b])
        torch.testing.assert_close(row.advantages[0], whole.advantages[b])


@pytest.mark.parametrize("kind", ["vtrace", "brace"])
def test_swapping_target_and_behavior_changes_the_result(kind):
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=10)
    kw = {"k": 5} if kind == "brace" else {}
    a = run(kind, rewards, values, target, behavior, mask, **kw)
    b = run(kind, rewards, values, behavior, target, mask, **kw)
    assert not torch.allclose(a.returns, b.returns)


def test_mc_tail_flag_changes_the_target_only_past_the_cap():
    mask = torch.ones(1, 30, dtype=torch.bool)
    rewards, values, target, behavior = random_inputs(mask, seed=11)
    on = brace(rewards, values, target, behavior, mask, k=4, mc_tail=True)
    off = brace(rewards, values, target, behavior, mask, k=4, mc_tail=False)
    assert not torch.allclose(on.returns[0, :26], off.returns[0, :26])
    torch.testing.assert_close(on.returns[0, 26:], off.returns[0, 26:])  # window reaches the end


def test_empty_inputs():
    for T in (0, 5):
        mask = torch.zeros(3, T, dtype=torch.bool)
        x = torch.zeros(3, T)
        for out in (gae(x, x, mask), vtrace(x, x, x, x, mask), brace(x, x, x, x, mask)):
            assert out.returns.shape == (3, T) and bool((out.returns == 0).all())
    mask = torch.zeros(0, 4, dtype=torch.bool)
    assert brace(
        torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4), mask
    ).returns.shape == (0, 4)


# ----------------------------------------------------------------------------- numerics at scale


@pytest.mark.slow
def test_brace_finite_at_paper_scale():
    """T = 32768, γ = λ = 1, log-ratios up to ±20, c̄ > 1: BRACE stays finite and close to float64."""
    g = torch.Generator().manual_seed(12)
    B, T = 2, 32768
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :1000] = False
    rewards = torch.zeros(B, T)
    rewards[:, -1] = 1.0
    values = torch.rand(B, T, generator=g)
    target = -torch.rand(B, T, generator=g) * 5
    behavior = target + (torch.rand(B, T, generator=g) * 40 - 20)
    behavior[0, ::2] = target[0, ::2] - 0.09  # long runs of w slightly above 1 (c = c̄)
    kw = dict(rho_bar=2.0, c_bar=1.5, k=100)
    with torch.no_grad():
        out32 = brace(rewards, values, target, behavior, mask, **kw)
        out64 = brace(*(x.double() for x in (rewards, values, target, behavior)), mask, **kw)
    assert bool(torch.isfinite(out32.returns).all()) and bool(
        torch.isfinite(out32.advantages).all()
    )
    scale = out64.returns.abs().max()
    assert float((out32.returns.double() - out64.returns).abs().max() / scale) < 1e-4


def test_vtrace_products_with_cbar_above_one_grow_where_brace_stays_bounded():
    T = 2000
    mask = torch.ones(1, T, dtype=torch.bool)
    rewards = torch.zeros(1, T, dtype=torch.float64)
    rewards[0, -1] = 1.0
    values = torch.full((1, T), 0.5, dtype=torch.float64)
    target = torch.zeros(1, T, dtype=torch.float64)
    behavior = torch.full((1, T), -0.5, dtype=torch.float64)  # w = e^0.5 > c̄
    vt = vtrace(rewards, values, target, behavior, mask, rho_bar=1.2, c_bar=1.1)
    br = brace(rewards, values, target, behavior, mask, rho_bar=1.2, c_bar=1.1, k=100)
    assert float(vt.returns.abs().max()) > 1e40  # 1.1^2000: the uncontrolled product
    assert float(br.returns.abs().max()) < 1.1**100 * 2


@pytest.mark.parametrize(
    "estimator",
    [
        lambda *a: vtrace(*a, rho_bar=1.2, c_bar=1.1),
        lambda *a: brace(*a, rho_bar=1.2, c_bar=1.1, k=None),
        lambda *a: brace(*a, rho_bar=1.2, c_bar=1.1, k=5000),
    ],
    ids=["vtrace", "brace-no-cap", "brace-k5000"],
)
def test_overflowing_weight_products_raise_instead_of_returning_nan(estimator):
    """Issue 17.8: a 30,000-action row whose weights all exceed c̄ overflowed to NaN silently."""
    T = 30000
    mask = torch.ones(1, T, dtype=torch.bool)
    rewards = torch.zeros(1, T)
    rewards[0, -1] = 1.0
    values = torch.rand(1, T, generator=torch.Generator().manual_seed(3))
    target = torch.zeros(1, T)
    behavior = torch.full((1, T), -0.5)  # w = e^0.5 > c̄ everywhere
    with pytest.raises(
        ValueError, match=r"^the importance-weight products overflowed .*use lmbda\*c_bar <= 1"
    ):
        estimator(rewards, values, target, behavior, mask)
    # The same row is fine under the paper's cap.
    out = brace(rewards, values, target, behavior, mask, rho_bar=1.2, c_bar=1.1, k=100)
    assert bool(torch.isfinite(out.returns).all())


# ----------------------------------------------------------------------------- devices / modes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    mask = layout_mask()
    inputs = random_inputs(mask, seed=13)
    cpu = brace(*inputs, mask, k=3)
    gpu = brace(*(x.cuda() for x in inputs), mask.cuda(), k=3)
    torch.testing.assert_close(gpu.returns.cpu(), cpu.returns)


def test_works_under_no_grad_and_inference_mode():
    mask = layout_mask()
    inputs = random_inputs(mask, seed=14)
    ref = brace(*inputs, mask)
    with torch.no_grad():
        torch.testing.assert_close(brace(*inputs, mask).returns, ref.returns)
    with torch.inference_mode():
        torch.testing.assert_close(brace(*inputs, mask).returns, ref.returns)


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    mask = layout_mask()
    r, v, t, b = random_inputs(mask)
    with pytest.raises(ValueError, match="^values has shape"):
        gae(r, v[:, :-1], mask)
    with pytest.raises(ValueError, match="^mask must be a torch.bool"):
        brace(r, v, t, b, mask.float())
    bad = v.clone()
    bad[mask] = math.nan
    with pytest.raises(ValueError, match="^values has non-finite values at action positions"):
        vtrace(r, bad, t, b, mask)
    bad = b.clone()
    bad[0, -1] = math.inf
    with pytest.raises(ValueError, match="^behavior_logprobs has non-finite"):
        brace(r, v, t, bad, mask)
    with pytest.raises(ValueError, match="^k must be an integer >= 0"):
        brace(r, v, t, b, mask, k=-1)
    with pytest.raises(ValueError, match="^gamma must be a number in \\[0, 1\\]; got 1.5"):
        gae(r, v, mask, gamma=1.5)
    with pytest.raises(ValueError, match="^lmbda must be"):
        vtrace(r, v, t, b, mask, lmbda=-0.1)
    with pytest.raises(ValueError, match="^c_bar must not exceed rho_bar"):
        brace(r, v, t, b, mask, rho_bar=1.0, c_bar=1.1)
    with pytest.raises(ValueError, match="^rho_bar must be a positive finite number"):
        vtrace(r, v, t, b, mask, rho_bar=0.0, c_bar=0.0)
    with pytest.raises(ValueError, match="^rewards must be a floating-point tensor"):
        gae(r.long(), v, mask)


# ----------------------------------------------------------------------------- properties


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 20))
    bits = draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))
    mask = torch.tensor(bits, dtype=torch.bool).reshape(B, T)
    seed = draw(st.integers(0, 2**16))
    k = draw(st.one_of(st.none(), st.integers(0, 25)))
    gamma = draw(st.sampled_from([1.0, 0.9]))
    lmbda = draw(st.sampled_from([1.0, 0.8]))
    clips = draw(st.sampled_from(CLIPS))
    mc_tail = draw(st.booleans())
    return (
        mask,
        seed,
        dict(gamma=gamma, lmbda=lmbda, rho_bar=clips[0], c_bar=clips[1], k=k, mc_tail=mc_tail),
    )


@settings(max_examples=60, deadline=None)
@given(batches())
def test_brace_property_random_masks(case):
    mask, seed, kw = case
    rewards, values, target, behavior = random_inputs(mask, seed=seed, scale=2.0)
    out = brace(rewards, values, target, behavior, mask, **kw)
    ref_adv, ref_ret = reference_targets("brace", rewards, values, mask, target, behavior, **kw)
    assert_close(out.returns, ref_ret, torch.float64)
    assert_close(out.advantages, ref_adv, torch.float64)


@settings(max_examples=40, deadline=None)
@given(batches())
def test_gae_and_vtrace_property_random_masks(case):
    mask, seed, kw = case
    rewards, values, target, behavior = random_inputs(mask, seed=seed, scale=2.0)
    kw_g = dict(gamma=kw["gamma"], lmbda=kw["lmbda"])
    kw_v = dict(kw_g, rho_bar=kw["rho_bar"], c_bar=kw["c_bar"])
    out = gae(rewards, values, mask, **kw_g)
    assert_close(
        out.returns, reference_targets("gae", rewards, values, mask, **kw_g)[1], torch.float64
    )
    out = vtrace(rewards, values, target, behavior, mask, **kw_v)
    ref = reference_targets("vtrace", rewards, values, mask, target, behavior, **kw_v)
    assert_close(out.returns, ref[1], torch.float64)
    assert_close(out.advantages, ref[0], torch.float64)


@pytest.mark.parametrize("rho_bar, c_bar", CLIPS)
def test_rho_in_advantage_scales_only_the_advantage_by_the_truncated_weight(rho_bar, c_bar):
    """V-trace's advantage is IMPALA's ρ_s (r_s + γ v_{s+1} − V_s), BRACE's the paper's unscaled
    one; either can take the other's, and the critic's target never changes."""
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=5, scale=0.7)
    rho = (target - behavior).exp().clamp(max=rho_bar)
    kw = dict(gamma=0.99, lmbda=0.95, rho_bar=rho_bar, c_bar=c_bar)
    for kind, default, extra in [
        ("vtrace", True, {}),
        ("brace", False, {"k": 5}),
        ("brace", False, {"k": 5, "mc_tail": False}),
    ]:
        args = (rewards, values, target, behavior, mask)
        scaled = run(kind, *args, **kw, **extra, rho_in_advantage=True)
        plain = run(kind, *args, **kw, **extra, rho_in_advantage=False)
        assert_close(scaled.returns, plain.returns, torch.float64)
        assert_close(
            scaled.advantages, torch.where(mask, rho * plain.advantages, 0.0), torch.float64
        )
        assert not torch.allclose(scaled.advantages, plain.advantages)  # ρ ≠ 1 on some actions
        default_out = run(kind, *args, **kw, **extra)
        assert torch.equal(default_out.advantages, (scaled if default else plain).advantages)


def test_uncapped_brace_with_rho_in_its_advantage_is_vtrace_in_both_outputs():
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=6, scale=0.5)
    kw = dict(gamma=0.98, lmbda=0.9, rho_bar=1.2, c_bar=1.1)
    vt = vtrace(rewards, values, target, behavior, mask, **kw)
    br = brace(rewards, values, target, behavior, mask, **kw, k=None, rho_in_advantage=True)
    assert_close(br.returns, vt.returns, torch.float64)
    assert_close(br.advantages, vt.advantages, torch.float64)


@pytest.mark.parametrize("kind", ["vtrace", "brace"])
def test_rho_in_advantage_must_be_a_bool(kind):
    mask = layout_mask()
    with pytest.raises(ValueError, match=r"^rho_in_advantage must be a bool; got 'yes'\.$"):
        run(kind, *random_inputs(mask), mask, rho_in_advantage="yes")
