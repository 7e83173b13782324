"""BRACE with a log-product budget: windows that end where the truncated trace product drifts
out of exp(±budget), checked against the float64 reference and the identities that pin it down."""

from __future__ import annotations

import math

import pytest
import torch

from brace_lightning.targets import BRACE
from brace_lightning.targets.functional import (
    brace,
    budget_windows,
    variable_window_scan,
    windowed_scan,
)
from tests.support.reference_targets import reference_targets
from tests.test_targets import (
    CLIPS,
    assert_close,
    discounted_return_to_go,
    layout_mask,
    random_inputs,
)


def brute_force_windows(log_c: torch.Tensor, budget: float, cap: int) -> torch.Tensor:
    """Windows grown one factor at a time; past the row's end every factor is 1 (log 0)."""
    out = torch.zeros(log_c.shape, dtype=torch.long)
    length = log_c.shape[1]
    for b in range(log_c.shape[0]):
        for s in range(length):
            total, n = 0.0, 0
            while n < cap:
                total += float(log_c[b, s + n]) if s + n < length else 0.0
                if abs(total) > budget:
                    break
                n += 1
            out[b, s] = n
    return out


@pytest.mark.parametrize("budget", [0.0, 0.4, 1.5, 50.0])
@pytest.mark.parametrize("cap", [0, 1, 5, 13, 64])
def test_budget_windows_match_brute_force(budget, cap):
    g = torch.Generator().manual_seed(cap)
    log_c = torch.randn(3, 40, generator=g, dtype=torch.float64) * 0.5
    log_c[1, 10:] = 0.0  # padding past a row's end never ends a window
    log_c[2, 7] = -math.inf  # a zero trace weight ends every window that reaches it
    n = budget_windows(log_c, budget, cap)
    assert torch.equal(n, brute_force_windows(log_c, budget, cap))


def test_variable_windows_of_one_length_are_the_fixed_window_scan():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(4, 50, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(4, 50, generator=g, dtype=torch.float64)
    for window in (0, 1, 6, 31, 50, 80):
        x, p = variable_window_scan(a, b, torch.full((4, 50), window, dtype=torch.long))
        x_ref, p_ref = windowed_scan(a, b, window)
        torch.testing.assert_close(x, x_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(p, p_ref, rtol=1e-12, atol=1e-12)


def test_variable_windows_sum_what_they_say():
    g = torch.Generator().manual_seed(1)
    a = torch.rand(2, 30, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(2, 30, generator=g, dtype=torch.float64)
    n = torch.randint(0, 40, (2, 30), generator=g)
    x, p = variable_window_scan(a, b, n)
    for row in range(2):
        for s in range(30):
            end = min(s + int(n[row, s]), 30)
            weights = [math.prod(float(a[row, i]) for i in range(s, t)) for t in range(s, end + 1)]
            expected = sum(weights[t - s] * float(b[row, t]) for t in range(s, end))
            assert float(x[row, s]) == pytest.approx(expected, rel=1e-10, abs=1e-12)
            assert float(p[row, s]) == pytest.approx(weights[-1], rel=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lmbda", [1.0, 0.95])
@pytest.mark.parametrize("clips", CLIPS)
@pytest.mark.parametrize("k", [7, None])
@pytest.mark.parametrize("budget", [0.0, 0.3, 1.5])
@pytest.mark.parametrize("mc_tail", [True, False])
def test_budget_matches_reference(dtype, lmbda, clips, k, budget, mc_tail):
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=5, scale=0.3)
    rewards, values, target, behavior = (
        x.to(dtype).double() for x in (rewards, values, target, behavior)
    )
    rho_bar, c_bar = clips
    kw = dict(gamma=0.99, lmbda=lmbda, rho_bar=rho_bar, c_bar=c_bar, k=k, mc_tail=mc_tail)
    out = brace(
        *(x.to(dtype) for x in (rewards, values, target, behavior)), mask, log_budget=budget, **kw
    )
    ref_adv, ref_ret = reference_targets(
        "brace", rewards, values, mask, target, behavior, log_budget=budget, **kw
    )
    assert_close(out.returns, ref_ret, dtype)
    assert_close(out.advantages, ref_adv, dtype)


def test_budget_changes_the_target_where_products_drift():
    mask = torch.ones(2, 300, dtype=torch.bool)
    rewards, values, target, behavior = random_inputs(mask, seed=7, scale=0.2)
    plain = brace(rewards, values, target, behavior, mask, k=100)
    budgeted = brace(rewards, values, target, behavior, mask, k=100, log_budget=1.0)
    assert not torch.allclose(plain.returns, budgeted.returns)


@pytest.mark.parametrize("k", [0, 9, 100, None])
def test_a_budget_nothing_reaches_is_the_fixed_cap(k):
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=8)
    kw = dict(gamma=0.98, lmbda=0.9, rho_bar=1.2, c_bar=1.1, k=k)
    plain = brace(rewards, values, target, behavior, mask, **kw)
    wide = brace(rewards, values, target, behavior, mask, log_budget=1e6, **kw)
    torch.testing.assert_close(wide.returns, plain.returns, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(wide.advantages, plain.advantages, rtol=1e-10, atol=1e-10)


def test_zero_budget_off_policy_is_the_monte_carlo_return():
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=9)
    behavior = target - 0.05 - torch.rand(mask.shape, dtype=torch.float64)  # every w > 1.05
    out = brace(rewards, values, target, behavior, mask, gamma=0.97, c_bar=1.01, log_budget=0.0)
    expected = discounted_return_to_go(rewards, mask, 0.97)
    torch.testing.assert_close(out.returns, expected, rtol=1e-10, atol=1e-10)


def test_zero_budget_on_policy_keeps_the_whole_cap():
    # w ≡ 1, λ = 1, c̄ ≥ 1: every trace factor is 1, so no product ever leaves exp(±0).
    mask = layout_mask()
    rewards, values, target, _ = random_inputs(mask, seed=10)
    kw = dict(gamma=0.99, k=5)
    plain = brace(rewards, values, target, target, mask, **kw)
    budgeted = brace(rewards, values, target, target, mask, log_budget=0.0, **kw)
    torch.testing.assert_close(budgeted.returns, plain.returns, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan, True, "1"])
def test_bad_budget_is_one_sentence(bad):
    mask = layout_mask()
    inputs = random_inputs(mask)
    with pytest.raises(ValueError, match=r"log_budget must be a finite number >= 0 or None"):
        brace(*inputs, mask, log_budget=bad)
    with pytest.raises(ValueError, match=r"log_budget must be a finite number >= 0 or None"):
        BRACE(log_budget=bad)


def test_estimator_passes_the_budget_and_logs_it():
    mask = torch.ones(2, 120, dtype=torch.bool)
    rewards, values, target, behavior = random_inputs(mask, seed=11, scale=0.2)
    estimator = BRACE(k=100, log_budget=0.5)
    out = estimator(
        rewards=rewards,
        values=values,
        target_logprobs=target,
        behavior_logprobs=behavior,
        mask=mask,
    )
    expected = brace(rewards, values, target, behavior, mask, k=100, log_budget=0.5)
    torch.testing.assert_close(out.returns, expected.returns)
    assert estimator.hparams()["log_budget"] == 0.5
    assert "log_budget=0.5" in repr(estimator)
