"""Issue 30's stabilizers: the ρ factor in GAE's advantage, GSPO's sequence ratio, the ESS-adaptive
actor step size and the drift between consecutive policy versions, each against a plain float64
reference."""

from __future__ import annotations

import math

import pytest
import torch

from brace_lightning.targets import GAE
from brace_lightning.targets.functional import gae
from tests.support.reference_targets import reference_targets
from tests.test_targets import assert_close, layout_mask, random_inputs

# --------------------------------------------------------------------------- ρ in GAE's advantage


@pytest.mark.slow
@pytest.mark.parametrize("rho_bar", [1.0, 1.2, 2.0])
def test_gae_rho_in_advantage_matches_a_float64_loop(rho_bar):
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=3, scale=0.7)
    ref_adv, ref_ret = reference_targets("gae", rewards, values, mask, gamma=0.99, lmbda=0.95)
    expected = torch.zeros_like(ref_adv)
    for b, t in mask.nonzero().tolist():
        rho = min(rho_bar, math.exp(float(target[b, t]) - float(behavior[b, t])))
        expected[b, t] = rho * float(ref_adv[b, t])
    out = GAE(gamma=0.99, lmbda=0.95, rho_in_advantage=True, rho_bar=rho_bar)(
        rewards=rewards, values=values, target_logprobs=target, behavior_logprobs=behavior, mask=mask
    )
    assert_close(out.advantages, expected, torch.float64)
    assert_close(out.returns, ref_ret, torch.float64)  # the critic's target never changes
    assert not torch.allclose(out.advantages, ref_adv)


def test_gae_without_rho_is_the_kernel_bit_for_bit_and_ignores_the_weights():
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=4)
    plain = gae(rewards, values, mask, gamma=0.9, lmbda=0.8)
    out = GAE(gamma=0.9, lmbda=0.8)(
        rewards=rewards, values=values, target_logprobs=target * 7, behavior_logprobs=behavior,
        mask=mask,
    )
    assert torch.equal(out.advantages, plain.advantages) and torch.equal(out.returns, plain.returns)
    assert not GAE().uses_importance_weights and GAE(rho_in_advantage=True).uses_importance_weights


def test_gae_rho_ignores_garbage_at_non_actions():
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=5)
    kw = dict(rewards=rewards, values=values, behavior_logprobs=behavior, mask=mask)
    target_bad = torch.where(mask, target, torch.tensor(float("nan"), dtype=torch.float64))
    gae_rho = GAE(rho_in_advantage=True, rho_bar=2.0)
    a = gae_rho(target_logprobs=target, **kw).advantages
    b = gae_rho(target_logprobs=target_bad, **kw).advantages
    assert torch.equal(a, b) and bool((a[~mask] == 0).all())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rho_in_advantage": 1}, r"^rho_in_advantage must be a bool; got 1\.$"),
        ({"rho_bar": 0.0}, r"^rho_bar must be a positive finite number; got 0\.0\.$"),
        ({"rho_bar": math.inf}, r"^rho_bar must be a positive finite number; got inf\.$"),
    ],
)
def test_gae_rho_arguments_are_checked_in_one_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GAE(**kwargs)
