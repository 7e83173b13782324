"""Issue 30's stabilizers: the ρ factor in GAE's advantage, GSPO's sequence ratio, the ESS- and
staleness-adaptive actor step sizes and the drift between consecutive policy versions, each against a plain float64
reference."""

from __future__ import annotations

import math

import pytest
import torch

from brace_lightning.models.policy import token_logprobs
from brace_lightning.module import BraceModule
from brace_lightning.objectives import GSPO
from brace_lightning.optim import clipped_step
from brace_lightning.step_metrics import effective_sample_size_fraction
from brace_lightning.step_size import (
    ESSAdaptiveStepSize,
    StalenessAdaptiveStepSize,
    global_ess_fraction,
    global_mean_staleness,
    scale_and_log,
)
from brace_lightning.targets import GAE
from brace_lightning.targets.functional import gae
from tests.support.reference_targets import reference_targets
from tests.test_hparams import _checkpoint
from tests.test_kl_reference import fit_steps, fixed_batch, sgd_module, weights
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
        rewards=rewards,
        values=values,
        target_logprobs=target,
        behavior_logprobs=behavior,
        mask=mask,
    )
    assert_close(out.advantages, expected, torch.float64)
    assert_close(out.returns, ref_ret, torch.float64)  # the critic's target never changes
    assert not torch.allclose(out.advantages, ref_adv)


def test_gae_without_rho_is_the_kernel_bit_for_bit_and_ignores_the_weights():
    mask = layout_mask()
    rewards, values, target, behavior = random_inputs(mask, seed=4)
    plain = gae(rewards, values, mask, gamma=0.9, lmbda=0.8)
    out = GAE(gamma=0.9, lmbda=0.8)(
        rewards=rewards,
        values=values,
        target_logprobs=target * 7,
        behavior_logprobs=behavior,
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


# --------------------------------------------------------------------------- GSPO


def _gspo_batch(seed: int, *, constant_advantage: bool = False):
    mask = layout_mask(12)
    g = torch.Generator().manual_seed(seed)
    shape = mask.shape
    proximal = -torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 0.1
    logprobs = proximal + torch.randn(shape, generator=g, dtype=torch.float64) * 0.02
    behavior = proximal + torch.randn(shape, generator=g, dtype=torch.float64) * 0.5
    advantages = torch.randn(shape, generator=g, dtype=torch.float64)
    if constant_advantage:
        advantages = advantages[:, :1].expand(shape).clone()
    return logprobs.requires_grad_(), proximal, behavior, advantages, mask


def _gspo_reference(logprobs, proximal, behavior, advantages, mask, clip_low, clip_high, cap):
    """Sequence-level GSPO written from its definition: per row s_i (differentiable through the
    row's mean log-ratio), per token −min(s_i A_t, clip(s_i) A_t), times min(w_i, C)."""
    rows = []
    for b in range(mask.shape[0]):
        cols = [t for t in range(mask.shape[1]) if bool(mask[b, t])]
        row = [torch.zeros((), dtype=torch.float64) for _ in range(mask.shape[1])]
        if cols:
            s = torch.exp(sum(logprobs[b, t] - float(proximal[b, t]) for t in cols) / len(cols))
            w = math.exp(sum(float(proximal[b, t] - behavior[b, t]) for t in cols) / len(cols))
            weight = 1.0 if cap is None else min(w, cap)
            s_clipped = torch.clamp(s, 1 - clip_low, 1 + clip_high)
            for t in cols:
                a = float(advantages[b, t])
                row[t] = -weight * torch.minimum(s * a, s_clipped * a)
        rows.append(torch.stack(row))
    return torch.stack(rows)


@pytest.mark.slow
@pytest.mark.parametrize("cap", [None, 1.1])
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_matches_the_sequence_definition_in_float64(cap, clip):
    """Loss values always; the gradient where GSPO-token and GSPO agree: advantages constant
    along each row."""
    logprobs, proximal, behavior, advantages, mask = _gspo_batch(0, constant_advantage=True)
    out = GSPO(clip_low=clip[0], clip_high=clip[1], behavior_weight_cap=cap)(
        logprobs=logprobs, proximal_logprobs=proximal, behavior_logprobs=behavior,
        advantages=advantages, mask=mask,
    )  # fmt: skip
    ref = _gspo_reference(logprobs, proximal, behavior, advantages, mask, *clip, cap)
    assert_close(out.token_loss.detach(), ref.detach(), torch.float64)
    (grad,) = torch.autograd.grad(out.token_loss.sum(), logprobs)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logprobs)
    assert_close(grad, ref_grad, torch.float64)
    clipped = out.stats["clip_low_count"] + out.stats["clip_high_count"]
    if clip[0] < 1e-3:
        assert 0 < clipped < mask.sum()  # the test reaches both branches
    if cap is not None:
        assert 0 < out.stats["truncated_count"] < mask.sum()


@pytest.mark.slow
def test_gspo_token_gradient_keeps_each_tokens_advantage():
    """With per-token advantages: ∂loss_t/∂log π_θ(y_t) = −s_i A_t on unclipped rows, 0 on
    clipped ones (a plain loop over the rows)."""
    logprobs, proximal, behavior, advantages, mask = _gspo_batch(1)
    clip_low, clip_high = 0.01, 0.01
    out = GSPO(clip_low=clip_low, clip_high=clip_high)(
        logprobs=logprobs, proximal_logprobs=proximal, behavior_logprobs=behavior,
        advantages=advantages, mask=mask,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(out.token_loss.sum(), logprobs)
    expected = torch.zeros_like(grad)
    for b in range(mask.shape[0]):
        cols = [t for t in range(mask.shape[1]) if bool(mask[b, t])]
        if not cols:
            continue
        s = math.exp(sum(float(logprobs[b, t].detach() - proximal[b, t]) for t in cols) / len(cols))
        for t in cols:
            a = float(advantages[b, t])
            cut = (a > 0 and s > 1 + clip_high) or (a < 0 and s < 1 - clip_low)
            expected[b, t] = 0.0 if cut else -s * a
            value = -min(max(s, 1 - clip_low), 1 + clip_high) * a if cut else -s * a
            assert math.isclose(
                float(out.token_loss[b, t].detach()), value, rel_tol=1e-10, abs_tol=1e-12
            )
    assert_close(grad, expected, torch.float64)


def test_gspo_ignores_garbage_at_non_actions_and_rows_are_independent():
    logprobs, proximal, behavior, advantages, mask = _gspo_batch(2)
    kw = dict(behavior_logprobs=behavior, advantages=advantages, mask=mask)
    gspo = GSPO(behavior_weight_cap=2.0)
    a = gspo(logprobs=logprobs, proximal_logprobs=proximal, **kw).token_loss
    bad = torch.where(mask, proximal, torch.tensor(float("nan"), dtype=torch.float64))
    b = gspo(logprobs=logprobs, proximal_logprobs=bad, **kw).token_loss
    assert torch.equal(a, b)
    moved = proximal.clone()
    moved[0] -= 0.3  # row 0's ratio changes; no other row's loss may
    c = gspo(logprobs=logprobs, proximal_logprobs=moved, **kw).token_loss
    assert not torch.equal(a[0], c[0]) and torch.equal(a[1:], c[1:])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_low": 1.0}, r"^clip_low must be in \(0, 1\); got 1\.0\.$"),
        ({"clip_high": 0}, r"^clip_high must be a positive finite number; got 0\.$"),
        (
            {"behavior_weight_cap": -1.0},
            r"^behavior_weight_cap must be a positive finite number or None; got -1\.0\.$",
        ),
    ],
)
def test_gspo_arguments_are_checked_in_one_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GSPO(**kwargs)


# --------------------------------------------------------------------------- ESS-adaptive step size


def _adamw_reference(params, grads_per_step, *, lr, betas, eps, weight_decay):
    """Plain float64 AdamW (Loshchilov & Hutter; torch's defaults) over a list of steps."""
    out = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in out]
    v = [torch.zeros_like(p) for p in out]
    for step, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            out[i] = out[i] * (1 - lr[step - 1] * weight_decay)
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            m_hat, v_hat = m[i] / (1 - betas[0] ** step), v[i] / (1 - betas[1] ** step)
            out[i] = out[i] - lr[step - 1] * m_hat / (v_hat.sqrt() + eps)
    return out


@pytest.mark.slow
def test_a_scaled_step_is_an_adamw_step_at_the_scaled_lr_and_the_lr_is_restored():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    grads, scales = [], [0.3, 1.0, 0.05]
    for scale in scales:
        loss = model(torch.randn(5, 4, dtype=torch.float64)).square().sum()
        loss.backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        clipped_step(model, optimizer, None, torch.device("cpu"), scale)
        assert optimizer.param_groups[0]["lr"] == 0.01  # restored, exactly
    for p, p0 in zip(model.parameters(), start, strict=True):
        p.data.copy_(p0)
    expected = _adamw_reference(
        list(model.parameters()), grads, lr=[0.01 * s for s in scales], betas=(0.9, 0.999),
        eps=1e-8, weight_decay=0.1,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for g, scale in zip(grads, scales, strict=True):
        for p, gp in zip(model.parameters(), g, strict=True):
            p.grad = gp.clone()
        clipped_step(model, optimizer, None, torch.device("cpu"), scale)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=1e-12, atol=1e-14)
    # Scaling the loss instead would not do it: AdamW's step is (almost) invariant to it.
    unscaled = _adamw_reference(
        start, [grads[0]], lr=[0.01], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1
    )
    scaled_loss = _adamw_reference(
        start, [[0.3 * g for g in grads[0]]], lr=[0.01], betas=(0.9, 0.999), eps=1e-8,
        weight_decay=0.1,
    )  # fmt: skip
    for a, b in zip(unscaled, scaled_loss, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


class _OneRank:
    world_size = 1
    strategy = None


def _slow_scale(log_w: torch.Tensor, mask: torch.Tensor, power: float, min_scale: float) -> float:
    w = [math.exp(float(x)) for x in log_w[mask].tolist()]
    ess = sum(w) ** 2 / (len(w) * sum(x * x for x in w))
    return min(1.0, max(min_scale, ess**power))


@pytest.mark.slow
@pytest.mark.parametrize(("power", "min_scale", "spread"), [(1.0, 0.1, 0.5), (0.5, 0.01, 2.0)])
def test_the_ess_factor_matches_a_float64_loop(power, min_scale, spread):
    mask = layout_mask()
    _, _, target, behavior = random_inputs(mask, seed=7, scale=spread)
    rule = ESSAdaptiveStepSize(power=power, min_scale=min_scale)
    got = rule(target, behavior, mask, _OneRank())
    assert math.isclose(got, _slow_scale(target - behavior, mask, power, min_scale), rel_tol=1e-12)
    assert got < 1.0
    assert rule(target, target, mask, _OneRank()) == 1.0  # on-policy: the full step
    floor = ESSAdaptiveStepSize(min_scale=0.9)(target, behavior, mask, _OneRank())
    assert floor == 0.9


def test_the_global_ess_is_the_logged_ess_on_one_rank_and_survives_huge_weights():
    mask = layout_mask()
    _, _, target, behavior = random_inputs(mask, seed=8, scale=1.0)
    log_w = (target - behavior) * 400  # weights up to e^1000: float64 would overflow unshifted
    expected = effective_sample_size_fraction(log_w[mask])
    assert math.isclose(global_ess_fraction(log_w, mask, _OneRank()), expected, rel_tol=1e-12)


def test_the_module_steps_the_actor_at_lr_times_the_logged_scale():
    """SGD is linear in its lr: the scaled run's actor moves exactly s times as far."""
    batch = fixed_batch()
    plain, scaled = sgd_module(seed=0), sgd_module(seed=0, actor_step_size=ESSAdaptiveStepSize())
    start = weights(plain.actor)
    plain_metrics, metrics = fit_steps(plain, batch), fit_steps(scaled, batch)
    s = metrics["lr/actor_scale"]
    assert "lr/actor_scale" not in plain_metrics
    assert math.isclose(s, metrics["weights/ess_fraction_tokens"], rel_tol=1e-5) and s < 0.99
    assert metrics["lr/actor"] == plain_metrics["lr/actor"] == 1.0  # the lr is restored
    moved_plain, moved = weights(plain.actor), weights(scaled.actor)
    for name, w0 in start.items():
        torch.testing.assert_close(
            moved[name] - w0, s * (moved_plain[name] - w0), rtol=1e-4, atol=1e-7
        )
    assert any(not torch.equal(moved[n], moved_plain[n]) for n in start)
    for name, value in weights(plain.critic).items():  # the critic's step is untouched
        assert torch.equal(value, weights(scaled.critic)[name])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"power": 0.0}, r"^power must be a positive finite number; got 0\.0\.$"),
        ({"min_scale": 0.0}, r"^min_scale must be in \(0, 1\]; got 0\.0\.$"),
        ({"min_scale": True}, r"^min_scale must be in \(0, 1\]; got True\.$"),
    ],
)
def test_step_size_arguments_are_checked_in_one_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ESSAdaptiveStepSize(**kwargs)


def _slow_staleness_scale(
    versions: torch.Tensor, mask: torch.Tensor, policy_version: int, lr: float, budget: float
) -> tuple[float, float]:
    ages = [policy_version - int(v) for v in versions[mask].tolist()]
    mean = sum(ages) / len(ages)
    return mean, min(1.0, budget / (mean * lr)) if mean > 0 else 1.0


@pytest.mark.parametrize(
    ("policy_version", "lr", "budget"), [(9, 2e-4, 8e-4), (16, 5e-5, 8e-4), (3, 1e-4, 8e-4)]
)
def test_the_staleness_factor_matches_a_float64_loop(policy_version, lr, budget):
    batch = fixed_batch()
    g = torch.Generator().manual_seed(5)
    sampled = torch.randint(0, policy_version + 1, batch.versions.shape, generator=g)
    batch.versions = torch.where(batch.mask, sampled, -1)
    mean, expected = _slow_staleness_scale(batch.versions, batch.mask, policy_version, lr, budget)
    assert math.isclose(
        global_mean_staleness(batch, policy_version, _OneRank()), mean, rel_tol=1e-15
    )
    rule = StalenessAdaptiveStepSize(lr_budget=budget)
    got = rule.scale(mean, lr)
    assert math.isclose(got, expected, rel_tol=1e-15)
    assert (got < 1.0) == (mean * lr > budget)


def test_the_staleness_factor_is_exactly_one_within_the_budget_and_caps_the_product():
    rule = StalenessAdaptiveStepSize(lr_budget=8e-4)
    assert rule.scale(0.0, 2e-4) == 1.0  # on-policy
    assert rule.scale(4.0, 2e-4) == 1.0  # S·lr = 8e-4, the budget itself: the full step
    assert rule.scale(16.0, 5e-5) == 1.0  # the same product, bit for bit
    for staleness in (5.0, 8.0, 16.0, 100.0):
        scaled_lr = 2e-4 * rule.scale(staleness, 2e-4)
        assert math.isclose(staleness * scaled_lr, 8e-4, rel_tol=1e-12)  # S̄ × lr = B


def test_staleness_and_ess_factors_multiply_and_each_is_logged():
    batch = fixed_batch()
    batch.versions = torch.where(batch.mask, 2, -1)  # 8 versions old at version 10
    g = torch.Generator().manual_seed(2)
    proximal = batch.behavior_logprobs + torch.randn(batch.mask.shape, generator=g) * 0.5

    class Scored:
        pass

    scored = Scored()
    scored.proximal = proximal
    ess = ESSAdaptiveStepSize(power=0.5, min_scale=0.01)
    rule = StalenessAdaptiveStepSize(lr_budget=8e-4, ess=ess)
    metrics: dict[str, float] = {}
    scale = scale_and_log(rule, batch, scored, _OneRank(), metrics, policy_version=10, lr=2e-4)
    ess_factor = ess(proximal, batch.behavior_logprobs, batch.mask, _OneRank())
    assert metrics["lr/actor_scale_staleness"] == 0.5 and ess_factor < 1.0
    assert metrics["lr/actor_scale_ess"] == ess_factor
    assert scale == metrics["lr/actor_scale"] == 0.5 * ess_factor
    alone: dict[str, float] = {}  # the ESS rule alone logs its factor under one name, as before
    assert scale_and_log(ess, batch, scored, _OneRank(), alone, policy_version=10, lr=2e-4) == (
        ess_factor
    )
    assert alone == {"lr/actor_scale": ess_factor}


def test_a_fresh_batch_under_the_staleness_rule_trains_bit_for_bit_as_without_it():
    batch = fixed_batch()
    plain = sgd_module(seed=0)
    ruled = sgd_module(seed=0, actor_step_size=StalenessAdaptiveStepSize(lr_budget=1e-3))
    plain_metrics, metrics = fit_steps(plain, batch), fit_steps(ruled, batch)
    assert metrics["lr/actor_scale"] == metrics["lr/actor_scale_staleness"] == 1.0
    assert "lr/actor_scale" not in plain_metrics
    for name, value in weights(plain.actor).items():
        assert torch.equal(value, weights(ruled.actor)[name])


def test_a_stale_batch_moves_the_actor_budget_over_staleness_times_lr_as_far():
    """SGD at lr 1, 4 versions stale, budget 0.5: the step runs at lr 0.125 (= 0.5 / 4)."""
    batch = fixed_batch()
    plain = sgd_module(seed=0)
    ruled = sgd_module(seed=0, actor_step_size=StalenessAdaptiveStepSize(lr_budget=0.5))
    for module in (plain, ruled):
        module.policy_version = 4  # the batch's tokens are version 0
    start = weights(plain.actor)
    fit_steps(plain, batch)
    metrics = fit_steps(ruled, batch)
    assert metrics["lr/actor_scale_staleness"] == 0.125
    assert metrics["lr/actor"] == 1.0  # the lr is restored
    moved_plain, moved = weights(plain.actor), weights(ruled.actor)
    for name, w0 in start.items():
        torch.testing.assert_close(
            moved[name] - w0, 0.125 * (moved_plain[name] - w0), rtol=1e-4, atol=1e-7
        )


@pytest.mark.parametrize("budget", [0.0, -1.0, math.inf, True, "1e-3"])
def test_the_staleness_budget_is_checked_in_one_sentence(budget):
    with pytest.raises(ValueError, match=r"^lr_budget must be a positive finite number; got .*\.$"):
        StalenessAdaptiveStepSize(lr_budget=budget)


# --------------------------------------------------------------------------- version drift


def test_version_drift_is_the_k3_kl_between_the_policy_before_and_after_the_step():
    batch = fixed_batch()
    module = sgd_module(seed=0, log_version_drift=True)
    with torch.no_grad():
        before = token_logprobs(module.actor, batch.input_ids, batch.attention_mask)[0]
    metrics = fit_steps(module, batch)
    with torch.no_grad():
        after = token_logprobs(module.actor, batch.input_ids, batch.attention_mask)[0]
    terms = []
    for b, t in batch.mask.nonzero().tolist():
        log_r = float(after[b, t]) - float(before[b, t])
        terms.append(math.exp(log_r) - 1.0 - log_r)
    expected = sum(terms) / len(terms)
    assert expected > 1e-4  # the step moved the policy
    assert math.isclose(metrics["kl/version_drift_k3"], expected, rel_tol=1e-3)
    # Off by default, and the extra forward changes no weight.
    plain = sgd_module(seed=0)
    assert "kl/version_drift_k3" not in fit_steps(plain, batch)
    for name, value in weights(plain.actor).items():
        assert torch.equal(value, weights(module.actor)[name])


def test_log_version_drift_must_be_a_bool():
    with pytest.raises(ValueError, match=r"^log_version_drift must be a bool; got 1\.$"):
        sgd_module(log_version_drift=1)


def test_the_new_options_survive_a_weights_only_checkpoint(tmp_path):
    kw = dict(tiny_hidden_size=32, tiny_num_layers=1)
    module = BraceModule(
        actor_step_size=ESSAdaptiveStepSize(power=0.5, min_scale=0.2),
        log_version_drift=True,
        value_target=GAE(rho_in_advantage=True, rho_bar=1.5),
        actor_objective=GSPO(behavior_weight_cap=3.0),
        **kw,
    )
    loaded = BraceModule.load_from_checkpoint(
        _checkpoint(module, tmp_path / "a.ckpt"), weights_only=True
    )
    assert vars(loaded.actor_step_size) == {"power": 0.5, "min_scale": 0.2}
    assert loaded.log_version_drift is True
    assert vars(loaded.value_target) == vars(module.value_target)
    assert vars(loaded.actor_objective) == vars(module.actor_objective)
    plain = BraceModule.load_from_checkpoint(
        _checkpoint(BraceModule(**kw), tmp_path / "b.ckpt"), weights_only=True
    )
    assert plain.actor_step_size is None and plain.log_version_drift is False


class _TwoRanks:
    """Ranks whose other rank holds ``other`` ``[M]`` log-weights (all actions): the strategy's
    reductions combine this rank's value with what that rank would send."""

    world_size = 2

    def __init__(self, other: torch.Tensor) -> None:
        self.other, self.strategy, self.top = other.double(), self, None

    def reduce(self, value: torch.Tensor, reduce_op: str) -> torch.Tensor:
        if reduce_op == "max":
            self.top = torch.maximum(value, self.other.max())
            return self.top
        shifted = torch.exp(self.other - self.top)
        theirs = torch.stack(
            [shifted.sum(), shifted.square().sum(), torch.tensor(1.0) * len(shifted)]
        )
        return value + theirs.double()


def test_the_ess_factor_is_taken_over_every_ranks_tokens():
    mask = layout_mask()
    _, _, target, behavior = random_inputs(mask, seed=9, scale=1.0)
    other = torch.randn(17, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2
    log_w = target - behavior
    expected = effective_sample_size_fraction(torch.cat([log_w[mask], other]))
    got = global_ess_fraction(log_w, mask, _TwoRanks(other))
    assert math.isclose(got, expected, rel_tol=1e-12)
    assert not math.isclose(got, effective_sample_size_fraction(log_w[mask]), rel_tol=1e-3)


def test_gspo_and_gae_rho_train_in_the_module():
    batch = fixed_batch()
    module = sgd_module(
        seed=0,
        actor_objective=GSPO(clip_low=0.2, clip_high=0.2, behavior_weight_cap=0.05),
        value_target=GAE(rho_in_advantage=True, rho_bar=1.0),
    )
    start = weights(module.actor)
    metrics = fit_steps(module, batch)
    assert module.policy_version == 1
    assert any(not torch.equal(v, weights(module.actor)[n]) for n, v in start.items())
    assert metrics["actor/sequence_ratio_mean"] == pytest.approx(1.0)  # one step: π_θ = π_prox
    # The tiny actor's log-probs sit below the batch's µ: every row's weight is small, yet above 0.05.
    assert metrics["actor/truncated_fraction"] > 0.0 and math.isfinite(metrics["actor/loss"])


def test_the_staleness_rule_with_its_ess_rule_survives_a_weights_only_checkpoint(tmp_path):
    rule = StalenessAdaptiveStepSize(lr_budget=8e-4, ess=ESSAdaptiveStepSize(power=0.5))
    module = BraceModule(actor_step_size=rule, tiny_hidden_size=32, tiny_num_layers=1)
    assert module.hparams["actor_step_size"] == {
        "class_path": "brace_lightning.step_size.StalenessAdaptiveStepSize",
        "init_args": {
            "lr_budget": 8e-4,
            "ess": {
                "class_path": "brace_lightning.step_size.ESSAdaptiveStepSize",
                "init_args": {"power": 0.5, "min_scale": 0.1},
            },
        },
    }
    loaded = BraceModule.load_from_checkpoint(
        _checkpoint(module, tmp_path / "a.ckpt"), weights_only=True
    )
    assert repr(loaded.actor_step_size) == repr(rule)


def test_a_bad_ess_rule_is_named_in_one_sentence():
    with pytest.raises(
        ValueError,
        match=r"^ess must be a brace_lightning\.step_size\.ESSAdaptiveStepSize or a .*; got 0\.5\.$",
    ):
        StalenessAdaptiveStepSize(lr_budget=8e-4, ess=0.5)
