"""Group-relative targets (GRPO, Dr. GRPO, RLOO), their importance-weighted and off-policy optimal
baselines and the loss aggregation modes: float64 references, identities and TRL's conventions."""

from __future__ import annotations

import math

import pytest
import torch

from brace_lightning.objectives.aggregation import (
    MODES,
    aggregate,
    check_mode,
    counted,
    row_factors,
)
from brace_lightning.targets import GAE, GRPO, RLOO, DrGRPO, group_advantages
from brace_lightning.targets.groups import optimal_baseline_weights, sequence_weights
from tests.support.reference_groups import (
    reference_aggregate,
    reference_group_advantages,
    reference_sequence_weights,
)

ESTIMATORS = ("GRPO", "DrGRPO", "RLOO")


def shuffled_groups(seed: int, groups: int = 5, size: int = 4):
    """Rewards [B] float64 and shuffled group ids [B] (plus one group of a single row)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(groups).repeat_interleave(size)
    ids = torch.cat([ids, torch.tensor([99])])
    perm = torch.randperm(len(ids), generator=g)
    rewards = torch.randn(len(ids), generator=g, dtype=torch.float64)
    return rewards, ids[perm] * 7 + 3  # ids need not be dense or sorted


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_group_advantages_match_float64_reference(estimator, weighted, seed):
    rewards, ids = shuffled_groups(seed)
    g = torch.Generator().manual_seed(100 + seed)
    weights = torch.rand(len(ids), generator=g, dtype=torch.float64) + 0.05 if weighted else None
    got = group_advantages(rewards, ids, estimator, eps=1e-4, weights=weights)
    want = reference_group_advantages(
        rewards.tolist(),
        ids.tolist(),
        estimator,
        1e-4,
        None if weights is None else weights.tolist(),
    )
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_equal_rewards_give_zero_advantage(estimator):
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0, 1.0], dtype=torch.float64)
    for weights in (None, torch.tensor([0.2, 1.0, 0.7, 1.2, 0.1, 0.9], dtype=torch.float64)):
        got = group_advantages(rewards, ids, estimator, weights=weights)
        torch.testing.assert_close(got, torch.zeros(6, dtype=torch.float64), atol=1e-15, rtol=0)


def test_rloo_with_two_samples_is_the_difference():
    rewards = torch.tensor([1.0, 0.25, 3.0, -1.0], dtype=torch.float64)
    ids = torch.tensor([4, 4, 9, 9])
    got = group_advantages(rewards, ids, "RLOO")
    want = torch.tensor([0.75, -0.75, 4.0, -4.0], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_grpo_follows_trl_unbiased_std_and_eps_on_the_std():
    """TRL 1.16: advantages = (r − mean) / (std(unbiased) + 1e-4), per group of num_generations."""
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(4 * 6, generator=g)
    ids = torch.arange(4).repeat_interleave(6)
    grouped = rewards.view(4, 6)
    trl = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, ids, "GRPO", eps=1e-4), trl.view(-1))
    dr = grouped - grouped.mean(1, keepdim=True)
    torch.testing.assert_close(group_advantages(rewards, ids, "DrGRPO"), dr.view(-1))


def test_a_group_of_one_row_gets_zero():
    rewards = torch.tensor([2.0, 1.0, 0.0])
    ids = torch.tensor([0, 1, 1])
    for estimator in ESTIMATORS:
        assert group_advantages(rewards, ids, estimator)[0] == 0.0


def test_bad_inputs_are_refused_in_one_sentence():
    rewards, ids = torch.zeros(3), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="estimator must be one of"):
        group_advantages(rewards, ids, "PPO")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group_ids must be an int64"):
        group_advantages(rewards, ids.int(), "GRPO")
    with pytest.raises(ValueError, match="weights must be finite"):
        group_advantages(rewards, ids, "GRPO", weights=torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="baseline_rho_bar must be None"):
        GRPO(baseline_rho_bar=0.0)


def token_inputs(seed: int, rows: int = 6, width: int = 9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=g) < 0.7
    mask[:, 0] = True
    target = -torch.rand(rows, width, generator=g, dtype=torch.float64)
    behavior = -torch.rand(rows, width, generator=g, dtype=torch.float64)
    rewards = torch.zeros(rows, width, dtype=torch.float64)
    last = width - 1 - mask.flip(1).float().argmax(1)
    rewards[torch.arange(rows), last] = torch.rand(rows, generator=g, dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 5, 5, 5])[:rows]
    return rewards, target, behavior, mask, ids


@pytest.mark.slow
@pytest.mark.parametrize("cls", [GRPO, DrGRPO, RLOO])
@pytest.mark.parametrize("rho_bar", [None, 1.0, 1.3])
def test_estimator_classes_match_the_reference_at_every_action(cls, rho_bar):
    rewards, target, behavior, mask, ids = token_inputs(1)
    out = cls(baseline_rho_bar=rho_bar)(
        rewards=rewards,
        values=torch.full_like(rewards, 123.0),  # no critic: values are ignored
        target_logprobs=target,
        behavior_logprobs=behavior,
        mask=mask,
        group_ids=ids,
    )
    weights = None
    if rho_bar is not None:
        weights = reference_sequence_weights(target, behavior, mask, rho_bar)
    want = reference_group_advantages(
        rewards.sum(1).tolist(), ids.tolist(), cls.estimator, 1e-4, weights
    )
    expected = torch.where(mask, torch.tensor(want, dtype=torch.float64)[:, None], 0.0)
    torch.testing.assert_close(out.advantages, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.returns, torch.where(mask, rewards.sum(1, keepdim=True), 0.0))


def test_sequence_weights_are_truncated_ratios_up_to_one_scale_per_group():
    rewards, target, behavior, mask, ids = token_inputs(2)
    got = sequence_weights(target, behavior, mask, ids, rho_bar=1.1)
    want = torch.tensor(
        reference_sequence_weights(target, behavior, mask, 1.1), dtype=torch.float64
    )
    for group in ids.unique():
        rows = ids == group
        torch.testing.assert_close(got[rows] / want[rows], (got[rows] / want[rows])[:1].expand(3))
        assert float(got[rows].max()) == 1.0
    huge = sequence_weights(target + 1e4, behavior, mask, ids, rho_bar=1.1)
    tiny = sequence_weights(target - 1e4, behavior, mask, ids, rho_bar=1.1)
    assert bool(torch.isfinite(huge).all()) and bool(torch.isfinite(tiny).all())


def target_kwargs(seed: int) -> dict[str, torch.Tensor]:
    """:func:`token_inputs` as a value target's keyword arguments (values: ignored, no critic)."""
    rewards, target, behavior, mask, ids = token_inputs(seed)
    return dict(
        rewards=rewards,
        values=rewards,
        target_logprobs=target,
        behavior_logprobs=behavior,
        mask=mask,
        group_ids=ids,
    )


def test_importance_weighted_baseline_changes_the_advantage():
    args = target_kwargs(3)
    plain, weighted = DrGRPO()(**args).advantages, DrGRPO(baseline_rho_bar=1.2)(**args).advantages
    assert not torch.allclose(plain, weighted)
    on_policy = DrGRPO(baseline_rho_bar=1.2)(
        **{**args, "behavior_logprobs": args["target_logprobs"]}
    ).advantages
    torch.testing.assert_close(on_policy, plain)  # π = µ: all weights 1, the plain mean


@pytest.mark.parametrize("cls", [GRPO, DrGRPO, RLOO])
@pytest.mark.parametrize("rho_bar", [None, 1.3])
def test_optimal_baseline_matches_the_reference_at_every_action(cls, rho_bar):
    args = target_kwargs(5)
    rewards, target, behavior, mask, ids = (
        args[k] for k in ("rewards", "target_logprobs", "behavior_logprobs", "mask", "group_ids")
    )
    norms = torch.rand(len(ids), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    norms = norms * 1e3 + 1e-3  # gradient norms over orders of magnitude
    target_ = cls(baseline_rho_bar=rho_bar, optimal_baseline=True)
    assert target_.needs_score_norms and target_.uses_importance_weights
    assert not cls().needs_score_norms and not cls(baseline_rho_bar=1.2).needs_score_norms
    out = target_(**args, score_sq_norms=norms)
    ratios = reference_sequence_weights(target, behavior, mask, rho_bar or math.inf)
    weights = [w * w * float(n) for w, n in zip(ratios, norms, strict=True)]
    want = reference_group_advantages(
        rewards.sum(1).tolist(), ids.tolist(), cls.estimator, 1e-4, weights
    )
    expected = torch.where(mask, torch.tensor(want, dtype=torch.float64)[:, None], 0.0)
    torch.testing.assert_close(out.advantages, expected, rtol=1e-10, atol=1e-12)


def test_optimal_baseline_weights_stay_finite_and_keep_zero_weights_zero():
    ids = torch.tensor([0, 0, 0, 1, 1])
    ratios = torch.tensor([1.0, 1e-200, 0.5, 0.0, 0.0], dtype=torch.float64)
    norms = torch.tensor([1e300, 1e300, 0.0, 2.0, 3.0], dtype=torch.float64)
    got = optimal_baseline_weights(ratios, norms, ids)
    assert bool(torch.isfinite(got).all())
    # 1e-200² · 1e300 underflows beside row 0's 1e300: weight 0, as a zero norm and a zero ratio
    assert got.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="score_sq_norms must be finite, non-negative"):
        optimal_baseline_weights(ratios, -norms, ids)
    with pytest.raises(ValueError, match="ratio_weights must be finite, non-negative"):
        optimal_baseline_weights(ratios[:2], norms, ids)


def test_the_optimal_baseline_minimises_the_off_policy_gradient_variance_on_a_bandit():
    """Exact, by enumeration: a softmax policy π over 5 actions, samples from µ ≠ π, the estimator
    w(a)(r(a) − b)∇log π(a). Its variance is a parabola in b whose minimum is E_µ[w²‖g‖²r] /
    E_µ[w²‖g‖²], the weights optimal_baseline_weights forms; the IS-weighted mean (weights w) and
    the plain mean are worse."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=g, dtype=torch.float64)
    mu = torch.softmax(torch.randn(5, generator=g, dtype=torch.float64), 0)
    pi = torch.softmax(theta, 0)
    rewards = torch.rand(5, generator=g, dtype=torch.float64)
    w = pi / mu
    scores = torch.eye(5, dtype=torch.float64) - pi  # ∇_θ log π(a) = e_a − π, one row per action
    sq_norms = scores.square().sum(1)

    def variance(b: float) -> float:
        estimates = w[:, None] * (rewards - b)[:, None] * scores  # [actions, params]
        mean = (mu[:, None] * estimates).sum(0)
        return float((mu * (estimates - mean).square().sum(1)).sum())

    # The weights of the estimator, applied to µ-probabilities (a group that is the whole support).
    ids = torch.zeros(5, dtype=torch.long)
    opob = optimal_baseline_weights(w / w.max(), sq_norms, ids) * mu
    best = float((opob * rewards).sum() / opob.sum())
    is_mean = float((mu * w * rewards).sum() / (mu * w).sum())
    plain = float((mu * rewards).sum())
    assert variance(best) < min(variance(is_mean), variance(plain), variance(0.0))
    for step in (1e-3, -1e-3):
        assert variance(best) < variance(best + step)


def test_the_optimal_baseline_needs_the_norms_and_a_bool():
    with pytest.raises(ValueError, match="score_sq_norms must be given to RLOO"):
        RLOO(optimal_baseline=True)(**target_kwargs(0))
    with pytest.raises(ValueError, match="optimal_baseline must be a bool; got 'yes'"):
        GRPO(optimal_baseline="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="score_norm must be 'parameters' or 'logits'; got 'grad'"):
        DrGRPO(optimal_baseline=True, score_norm="grad")
    with pytest.raises(ValueError, match="score_norm is read only with optimal_baseline=True"):
        GRPO(score_norm="logits")
    assert GRPO().score_norm == "parameters"
    assert GRPO(optimal_baseline=True, score_norm="logits").score_norm == "logits"


def test_critic_free_targets_need_no_critic_and_need_group_ids():
    assert not GRPO().needs_critic and not DrGRPO().needs_critic and not RLOO().needs_critic
    assert GAE().needs_critic
    rewards, target, behavior, mask, _ = token_inputs(0)
    with pytest.raises(ValueError, match="group_ids must be given to GRPO"):
        GRPO()(
            rewards=rewards,
            values=rewards,
            target_logprobs=target,
            behavior_logprobs=behavior,
            mask=mask,
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "max_len"), [(mode, None) for mode in MODES] + [("seq_mean_token_sum", 16)]
)
def test_aggregate_matches_float64_reference(mode, max_len):
    _, loss, _, mask, _ = token_inputs(4)
    mask[2] = False  # a row without actions still counts as a sequence
    garbage = torch.where(mask, loss, 1e6)  # masked positions are ignored
    got = aggregate(garbage, mask, mode, max_len)
    assert math.isclose(float(got), reference_aggregate(loss, mask, mode, max_len), rel_tol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_row_factors_and_counts_split_over_micro_batches_give_the_whole_batch(mode):
    """The module's form: Σ over micro-batches of (loss · factor).sum() / the step's count."""
    _, loss, _, mask, _ = token_inputs(5)
    max_len = 12 if mode == "seq_mean_token_sum" else None
    count = counted(mask, mode).sum()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        part = torch.where(mask[rows], loss[rows], 0.0)
        factors = row_factors(mask[rows], mode, max_len, torch.float64)
        total += float((part if factors is None else part * factors).sum() / count)
    assert math.isclose(total, float(aggregate(loss, mask, mode, max_len)), rel_tol=1e-12)


def test_modes_differ_and_bad_modes_are_refused():
    _, loss, _, mask, _ = token_inputs(6)
    values = {float(aggregate(loss, mask, mode)) for mode in MODES}
    assert len(values) == 3
    with pytest.raises(ValueError, match="loss_aggregation must be one of"):
        check_mode("sum")
    with pytest.raises(ValueError, match="loss_max_len is read by"):
        check_mode("token_mean", 10)


def test_aggregation_modes_are_trl_loss_types():
    """TRL 1.16 GRPOTrainer._compute_loss: "grpo", "dr_grpo" and "bnpo"/"dapo" (one process)."""
    _, loss, _, mask, _ = token_inputs(7)
    m = mask.to(loss.dtype)
    grpo = ((loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    dr_grpo = (loss * m).sum() / (loss.size(0) * 32)
    bnpo = (loss * m).sum() / m.sum().clamp(min=1.0)
    torch.testing.assert_close(aggregate(loss, mask, "seq_mean_token_mean"), grpo)
    torch.testing.assert_close(aggregate(loss, mask, "seq_mean_token_sum", 32), dr_grpo)
    torch.testing.assert_close(aggregate(loss, mask, "token_mean"), bnpo)
