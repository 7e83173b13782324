"""The exact MDP of :mod:`brace_lightning.sim` and the critic fixed points it exposes.

Expectations in comments were measured with the seeds used here.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from brace_lightning.metrics import HorizonBeta, ValueBiasGap, power_of_two_edges
from brace_lightning.metrics.functional import reward_to_go
from brace_lightning.sim import (
    CountingMDP,
    action_values,
    exact_values,
    fit_critic,
    natural_gradient_step,
    occupancy,
    per_token_kl,
    perturb,
    sample,
    stale_pair,
    state_values,
    uniform_logits,
)
from brace_lightning.targets import BRACE, GAE, VTrace


def _random_logits(mdp: CountingMDP, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(mdp.logits_shape, generator=generator, dtype=torch.float64)


def _gap(table: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor) -> float:
    metric = ValueBiasGap()
    mask = torch.ones_like(counts, dtype=torch.bool)
    metric.update(state_values(table, counts), state_values(reference, counts), mask)
    return float(metric.compute())


# --------------------------------------------------------------------------- the MDP


def test_exact_values_match_brute_force_enumeration() -> None:
    mdp = CountingMDP(horizon=5, num_actions=3, threshold=2)
    logits = _random_logits(mdp, seed=0)
    probs = torch.softmax(logits, dim=-1)
    values = exact_values(mdp, logits)
    for t in range(mdp.horizon):
        for c in range(mdp.num_counts):
            expected = 0.0
            for suffix in itertools.product(range(mdp.num_actions), repeat=mdp.horizon - t):
                p, count = 1.0, c
                for step, action in enumerate(suffix):
                    p *= float(probs[t + step, count, action])
                    count = min(count + (action == 0), mdp.threshold)
                expected += p * float(count >= mdp.threshold)
            assert values[t, c].item() == pytest.approx(expected, abs=1e-12)
    assert torch.equal(values[mdp.horizon], torch.zeros(mdp.num_counts, dtype=torch.float64))


def test_action_values_average_to_state_values() -> None:
    mdp = CountingMDP(horizon=12, num_actions=4, threshold=4)
    logits = _random_logits(mdp, seed=1)
    values = exact_values(mdp, logits)
    q = action_values(mdp, values)
    averaged = (torch.softmax(logits, dim=-1) * q).sum(dim=-1)
    torch.testing.assert_close(averaged, values[:-1], rtol=0, atol=1e-12)


def test_exact_values_and_occupancy_agree_with_monte_carlo() -> None:
    mdp = CountingMDP(horizon=40, num_actions=3, threshold=14)
    logits = _random_logits(mdp, seed=2, scale=0.5)
    values = exact_values(mdp, logits)
    data = sample(mdp, logits, logits, batch_size=20000, generator=torch.Generator().manual_seed(3))
    success = data.rewards[:, -1]
    # Start state: every row visits it.
    standard_error = math.sqrt(values[0, 0].item() * (1 - values[0, 0].item()) / 20000)
    assert abs(success.mean().item() - values[0, 0].item()) < 4 * standard_error
    # Every well-visited state: mean reward of the rows through it ≈ V(t, c).
    flat = torch.arange(mdp.horizon) * mdp.num_counts + data.counts
    visits = torch.bincount(flat.reshape(-1), minlength=mdp.horizon * mdp.num_counts)
    sums = torch.bincount(
        flat.reshape(-1),
        weights=success[:, None].expand_as(flat).reshape(-1),
        minlength=len(visits),
    )
    exact = values[:-1].reshape(-1)
    busy = visits >= 400
    z = (sums[busy] / visits[busy] - exact[busy]) / torch.sqrt(
        exact[busy] * (1 - exact[busy]) / visits[busy] + 1e-12
    )
    assert busy.sum() > 200
    assert z.abs().max() < 5.0
    # Occupancy = visitation frequencies.
    frequencies = visits.reshape(mdp.horizon, mdp.num_counts) / 20000
    assert (frequencies - occupancy(mdp, logits)).abs().max() < 0.02
    torch.testing.assert_close(
        occupancy(mdp, logits).sum(dim=1), torch.ones(mdp.horizon, dtype=torch.float64)
    )


def test_sample_records_the_trainer_tensors_consistently() -> None:
    mdp = CountingMDP(horizon=16, num_actions=5, threshold=5)
    mu, pi = _random_logits(mdp, seed=4), _random_logits(mdp, seed=5)
    data = sample(mdp, mu, pi, batch_size=64, generator=torch.Generator().manual_seed(6))
    assert data.mask.dtype == torch.bool and bool(data.mask.all())
    for name in ("rewards", "target_logprobs", "behavior_logprobs"):
        assert getattr(data, name).shape == (64, 16)
        assert getattr(data, name).dtype == torch.float64
    assert torch.equal(data.counts[:, 0], torch.zeros(64, dtype=torch.long))
    expected_counts = mdp.next_count(data.counts[:, :-1], data.actions[:, :-1])
    assert torch.equal(data.counts[:, 1:], expected_counts)
    final = mdp.next_count(data.counts[:, -1], data.actions[:, -1])
    assert torch.equal(data.rewards[:, -1], (final >= mdp.threshold).double())
    assert bool((data.rewards[:, :-1] == 0).all())
    positions = torch.arange(16).expand(64, 16)
    log_mu = torch.log_softmax(mu, dim=-1)[positions, data.counts, data.actions]
    log_pi = torch.log_softmax(pi, dim=-1)[positions, data.counts, data.actions]
    torch.testing.assert_close(data.behavior_logprobs, log_mu)
    torch.testing.assert_close(data.target_logprobs, log_pi)


def test_long_horizon_dynamic_programming_is_cheap() -> None:
    mdp = CountingMDP.calibrated(4096, 2, success=0.2)
    values = exact_values(mdp, uniform_logits(mdp))
    assert values.shape == (4097, mdp.num_counts)
    # Calibrated: the uniform policy succeeds with probability just below 0.2 (measured 0.196).
    assert 0.17 < values[0, 0].item() <= 0.2


def test_calibrated_threshold_sets_the_initial_success() -> None:
    for horizon in (64, 256, 1024):
        mdp = CountingMDP.calibrated(horizon, 4, success=0.1)
        start = exact_values(mdp, uniform_logits(mdp))[0, 0].item()
        assert 0.07 < start <= 0.1


def test_state_values_look_up_the_table() -> None:
    table = torch.arange(12, dtype=torch.float64).reshape(4, 3)  # T = 3, C = 3
    counts = torch.tensor([[0, 1, 2], [0, 0, 1]])
    expected = torch.tensor([[0.0, 4.0, 8.0], [0.0, 3.0, 7.0]], dtype=torch.float64)
    assert torch.equal(state_values(table, counts), expected)


# --------------------------------------------------------------------------- policies


def test_natural_gradient_steps_improve_the_policy() -> None:
    mdp = CountingMDP.calibrated(64, 4, success=0.1)
    logits = uniform_logits(mdp)
    starts = []
    for _ in range(4):
        starts.append(exact_values(mdp, logits)[0, 0].item())
        logits = natural_gradient_step(mdp, logits, step_size=0.5)
    assert all(b > a + 0.02 for a, b in zip(starts, starts[1:], strict=False))


def test_noise_flag_changes_the_step() -> None:
    mdp = CountingMDP(horizon=8, num_actions=3, threshold=3)
    logits = uniform_logits(mdp)
    plain = natural_gradient_step(mdp, logits, step_size=0.5)
    noisy = natural_gradient_step(
        mdp, logits, step_size=0.5, noise=0.1, generator=torch.Generator().manual_seed(0)
    )
    assert 0.05 < (noisy - plain).std().item() < 0.15


def test_stale_pair_reads_two_versions_of_one_sequence() -> None:
    mdp = CountingMDP.calibrated(64, 4, success=0.1)
    same = stale_pair(mdp, version=5, staleness=0, step_size=0.5, noise=0.05)
    assert same.behavior_logits is same.target_logits
    pairs = [stale_pair(mdp, version=5, staleness=s, step_size=0.5, noise=0.05) for s in (1, 3)]
    for pair in pairs:
        assert torch.equal(pair.target_logits, same.target_logits)
    starts = [exact_values(mdp, p.behavior_logits)[0, 0].item() for p in pairs]
    target = exact_values(mdp, same.target_logits)[0, 0].item()
    assert target > starts[0] > starts[1]  # older µ is worse
    kls = [per_token_kl(mdp, p.behavior_logits, p.target_logits).item() for p in pairs]
    assert 0 < kls[0] < kls[1]
    oldest = stale_pair(mdp, version=5, staleness=5, step_size=0.5, noise=0.05)
    assert torch.equal(oldest.behavior_logits, uniform_logits(mdp))
    with pytest.raises(ValueError, match="staleness"):
        stale_pair(mdp, version=2, staleness=3, step_size=0.5)


def test_perturb_hits_the_requested_per_token_kl() -> None:
    mdp = CountingMDP.calibrated(64, 4, success=0.1)
    pi = stale_pair(mdp, version=3, staleness=0, step_size=0.5).target_logits
    for kl in (0.001, 0.02):
        mu = perturb(mdp, pi, kl=kl, seed=1)
        assert per_token_kl(mdp, mu, pi).item() == pytest.approx(kl, rel=2e-3)
    assert torch.equal(perturb(mdp, pi, kl=0.0), pi)
    # The data agree: −E_µ[log w] estimates the same KL.
    mu = perturb(mdp, pi, kl=0.02, seed=1)
    data = sample(mdp, mu, pi, batch_size=4000, generator=torch.Generator().manual_seed(2))
    log_w = data.target_logprobs - data.behavior_logprobs
    assert -log_w.mean().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"horizon": 0, "num_actions": 2, "threshold": 1}, "horizon"),
        ({"horizon": 4, "num_actions": 1, "threshold": 1}, "num_actions"),
        ({"horizon": 4, "num_actions": 2, "threshold": 5}, "threshold"),
    ],
)
def test_mdp_validates_its_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CountingMDP(**kwargs)


def test_functions_reject_bad_logits_and_arguments() -> None:
    mdp = CountingMDP(horizon=4, num_actions=2, threshold=2)
    with pytest.raises(ValueError, match=r"logits has shape"):
        exact_values(mdp, torch.zeros(4, 2, 2, dtype=torch.float64))
    bad = uniform_logits(mdp)
    bad[0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        occupancy(mdp, bad)
    with pytest.raises(ValueError, match="batch_size"):
        sample(mdp, uniform_logits(mdp), uniform_logits(mdp), batch_size=0)
    with pytest.raises(ValueError, match="kl"):
        perturb(mdp, uniform_logits(mdp), kl=-1.0)
    with pytest.raises(ValueError, match="success"):
        CountingMDP.calibrated(8, 2, success=1.0)


# --------------------------------------------------------------------------- critic fixed points


@pytest.fixture(scope="module")
def stale_setting() -> dict[str, object]:
    """T = 64, µ four NPG steps behind π (per-token KL 0.011, V^π(s0) 0.85, V^µ(s0) 0.44)."""
    mdp = CountingMDP.calibrated(64, 4, success=0.1)
    mu, pi = stale_pair(mdp, version=8, staleness=4, step_size=0.5, noise=0.05)
    data = sample(mdp, mu, pi, batch_size=4096, generator=torch.Generator().manual_seed(0))
    return {
        "mdp": mdp,
        "data": data,
        "v_pi": exact_values(mdp, pi),
        "v_mu": exact_values(mdp, mu),
    }


def test_on_policy_every_estimator_converges_to_v_pi() -> None:
    mdp = CountingMDP.calibrated(64, 4, success=0.1)
    pi = stale_pair(mdp, version=4, staleness=0, step_size=0.5).target_logits
    data = sample(mdp, pi, pi, batch_size=4096, generator=torch.Generator().manual_seed(1))
    v_pi = exact_values(mdp, pi)
    targets = (
        GAE(),
        GAE(lmbda=0.9),
        VTrace(),
        BRACE(k=0),
        BRACE(k=10),
        BRACE(),
        BRACE(k=10, mc_tail=False),
        BRACE(k=10, lmbda=0.9),
    )
    for target in targets:
        fit = fit_critic(mdp, data, target)
        assert fit.converged, target
        # Sampling noise only (measured 0.012 with λ = 1, where every target is the return R,
        # and 0.008 with λ = 0.9, where the critic bootstraps).
        assert _gap(fit.values, v_pi, data.counts) < 0.02, target


def test_stale_gae_critic_learns_v_mu(stale_setting: dict) -> None:
    mdp, data = stale_setting["mdp"], stale_setting["data"]
    fit = fit_critic(mdp, data, GAE())
    assert fit.converged and fit.iterations <= 2  # λ = 1: the target ignores the critic
    to_pi = _gap(fit.values, stale_setting["v_pi"], data.counts)
    to_mu = _gap(fit.values, stale_setting["v_mu"], data.counts)
    # Measured: 0.24 to V^π, 0.011 to V^µ (Proposition 1).
    assert to_mu < 0.1 * to_pi
    assert to_pi > 0.2


def test_stale_brace_critic_is_closer_to_v_pi_than_gae(stale_setting: dict) -> None:
    mdp, data = stale_setting["mdp"], stale_setting["data"]
    v_pi = stale_setting["v_pi"]
    gae = _gap(fit_critic(mdp, data, GAE()).values, v_pi, data.counts)
    brace = _gap(fit_critic(mdp, data, BRACE(k=20)).values, v_pi, data.counts)
    vtrace = _gap(fit_critic(mdp, data, BRACE(k=None)).values, v_pi, data.counts)
    # Measured: GAE 0.24, BRACE(k=20) 0.11, k=∞ (V-trace with ρ̄ = 1.2) 0.04.
    assert brace < 0.6 * gae
    assert vtrace < brace


def test_fit_critic_flags_change_the_path_not_the_fixed_point(stale_setting: dict) -> None:
    mdp, data = stale_setting["mdp"], stale_setting["data"]
    target = BRACE(k=20)
    plain = fit_critic(mdp, data, target, tol=1e-6)
    damped = fit_critic(mdp, data, target, lr=0.5, tol=1e-6)
    warm = fit_critic(mdp, data, target, init=stale_setting["v_pi"], tol=1e-6)
    short = fit_critic(mdp, data, target, max_iterations=2)
    assert damped.iterations > plain.iterations
    assert not short.converged and short.iterations == 2
    visited = plain.visits > 0
    for other in (damped, warm):
        assert other.converged
        diff = (other.values[:-1] - plain.values[:-1])[visited].abs().max()
        assert diff < 1e-4
    # Unvisited states keep their initial value.
    assert torch.equal(warm.values[:-1][~visited], stale_setting["v_pi"][:-1][~visited])
    with pytest.raises(ValueError, match="lr"):
        fit_critic(mdp, data, target, lr=0.0)
    with pytest.raises(ValueError, match="init"):
        fit_critic(mdp, data, target, init=torch.zeros(3, 3))


def test_beta_decays_under_vtrace_but_not_under_brace_past_k() -> None:
    mdp = CountingMDP.calibrated(128, 4, success=0.1)
    pi = stale_pair(mdp, version=5, staleness=0, step_size=0.5).target_logits
    mu = perturb(mdp, pi, kl=0.02, seed=1)
    data = sample(mdp, mu, pi, batch_size=4096, generator=torch.Generator().manual_seed(2))
    values = state_values(exact_values(mdp, mu), data.counts)
    realized = reward_to_go(data.rewards, data.mask)
    edges = power_of_two_edges(128, start=1)  # 1, 2, 4, ..., 128

    def beta(target: object) -> torch.Tensor:
        out = target(
            rewards=data.rewards,
            values=values,
            target_logprobs=data.target_logprobs,
            behavior_logprobs=data.behavior_logprobs,
            mask=data.mask,
        )
        metric = HorizonBeta(edges)
        metric.update(out.returns, realized, data.mask)
        result = metric.compute()
        assert bool(result.defined.all())
        return result.value

    gae, brace = beta(GAE()), beta(BRACE(k=8))
    assert torch.allclose(gae, torch.ones_like(gae))
    # Bins [16, 32), [32, 64), [64, 128), [128, ∞) are indices 4..7. Measured:
    # BRACE k = ∞ 0.89, 0.73, 0.42, 0.20; VTrace() 0.84, 0.67, 0.35, 0.11: the reward drains out.
    for vtrace in (beta(BRACE(k=None)), beta(VTrace())):
        assert vtrace[7] < 0.4 * vtrace[4]
        assert brace[7] > 2 * vtrace[7]
    # BRACE k = 8: 0.93, 0.88, 0.79, 0.73, levelling off near E[Π_8 c].
    assert brace[7] > 0.7 * brace[4]


# --------------------------------------------------------------------------- the closed loop


def _closed_loop(**overrides: object) -> object:
    from brace_lightning.closed_loop import ClosedLoopConfig, run_closed_loop
    from brace_lightning.objectives import PPOClip

    settings: dict[str, object] = {"horizon": 8, "versions": 30, "batch_size": 64, "seed": 3}
    settings.update(overrides)
    return run_closed_loop(ClosedLoopConfig(**settings), BRACE(k=4), PPOClip())  # type: ignore[arg-type]


def test_closed_loop_exact_value_matches_monte_carlo_reward() -> None:
    # On-policy (S = 0, no drift) each version's sampled mean reward is a Monte-Carlo estimate of
    # the logged exact V^π(s0); the standardized mean difference over versions is ~N(0, 1).
    log = _closed_loop()
    values = torch.tensor(log.value_pi)
    rewards = torch.tensor(log.reward)
    std = (values * (1 - values) / 64).sqrt()
    z = float(((rewards - values) / std).sum() / math.sqrt(len(values)))
    assert abs(z) < 4.0
    assert log.value_pi[-1] > log.value_pi[0] + 0.1  # the actor learns from its samples


def test_closed_loop_seed_reproduces_exactly_and_staleness_drift_show() -> None:
    first = _closed_loop(staleness=2, drift="sparse", drift_kl=0.05, critic="mlp", critic_lr=0.01)
    second = _closed_loop(staleness=2, drift="sparse", drift_kl=0.05, critic="mlp", critic_lr=0.01)
    other = _closed_loop(
        staleness=2, drift="sparse", drift_kl=0.05, critic="mlp", critic_lr=0.01, seed=4
    )
    assert first.as_dict() == second.as_dict()  # type: ignore[attr-defined]
    assert first.as_dict() != other.as_dict()  # type: ignore[attr-defined]
    assert min(first.kl[3:]) > 0.0  # type: ignore[attr-defined]
    # Each of the 8 tokens adds at most log c̄ (c̄ = 1.1 by default) to the truncated log-product.
    assert max(first.log_product_mean) <= 8 * math.log(1.1)  # type: ignore[attr-defined]


def test_closed_loop_rejects_bad_config() -> None:
    from brace_lightning.closed_loop import ClosedLoopConfig

    with pytest.raises(ValueError, match="staleness must be >= 0; got -1"):
        ClosedLoopConfig(staleness=-1)


def test_closed_loop_beta_is_one_for_the_plain_return_and_logged_per_horizon_bin() -> None:
    from brace_lightning.closed_loop import ClosedLoopConfig, run_closed_loop
    from brace_lightning.objectives import PPOClip

    config = ClosedLoopConfig(horizon=16, versions=6, batch_size=64, staleness=2, seed=1)
    gae = run_closed_loop(config, GAE(), PPOClip())
    assert gae.beta_edges == [1, 2, 4, 8, 16]
    for row in gae.beta:  # GAE with λ = 1 regresses on the return itself: slope 1 where defined
        assert [b for b in row if b is not None] == pytest.approx(
            [1.0] * sum(b is not None for b in row)
        )
        assert sum(b is not None for b in row) >= 3
    vtrace = run_closed_loop(config, VTrace(), PPOClip())
    assert any(b is not None and abs(b - 1.0) > 1e-3 for row in vtrace.beta[2:] for b in row)


def test_drift_is_scaled_to_the_requested_kl_on_pi_occupancy() -> None:
    from brace_lightning.closed_loop import _drift

    mdp = CountingMDP.calibrated(64, 4, success=0.1)
    pi = _random_logits(mdp, seed=5, scale=0.5)
    log_pi = torch.log_softmax(pi, dim=-1)
    weights = occupancy(mdp, pi) / mdp.horizon
    for kind in ("gaussian", "sparse"):
        mu = _drift(mdp, pi, log_pi, weights, kind, 0.02, torch.Generator().manual_seed(0))  # type: ignore[arg-type]
        log_mu = torch.log_softmax(mu, dim=-1)
        kl = float((weights * (log_mu.exp() * (log_mu - log_pi)).sum(-1)).sum())
        assert kl == pytest.approx(0.02, rel=1e-3)
        unreached = weights <= 1e-14
        assert bool(unreached.any()) and torch.equal(mu[unreached], pi[unreached])


def test_mlp_actor_learns_and_moves_states_it_never_visited() -> None:
    from brace_lightning.closed_loop import ClosedLoopConfig, run_closed_loop
    from brace_lightning.objectives import PPOClip

    # A tabular actor only moves the logits of sampled states; the MLP's shared weights move all,
    # so its per-token KL between versions is spread over states the sampler rarely reaches.
    log = run_closed_loop(
        ClosedLoopConfig(
            horizon=16, versions=40, batch_size=64, actor="mlp", actor_lr=0.03, seed=2
        ),
        BRACE(k=4),
        PPOClip(),
    )
    assert log.value_pi[-1] > log.value_pi[0] + 0.1
    # One gradient step on a single state (t = 0, c = 0): the table moves only there; the MLP moves
    # every state (its first step only trains the zero-initialized output layer's bias and weights).
    from brace_lightning.closed_loop import _Actor

    mdp = CountingMDP.calibrated(16, 4, success=0.1)
    for kind, moves_elsewhere in (("tabular", False), ("mlp", True)):
        actor = _Actor(ClosedLoopConfig(horizon=16, actor=kind), mdp)  # type: ignore[arg-type]
        before = actor.table()
        assert torch.equal(before, torch.zeros_like(before))  # both start uniform
        loss = -actor.log_probs(torch.tensor([[0]]), torch.tensor([[0]]))[0, 0, 0]
        actor.optimizer.zero_grad()
        loss.backward()
        actor.optimizer.step()
        change = (actor.table() - before).abs().sum(-1)
        assert float(change[0, 0]) > 0.0
        assert (float(change[5:, 1:].max()) > 0.0) is moves_elsewhere
    narrow = ClosedLoopConfig(horizon=16, versions=3, actor="mlp", actor_hidden=4, seed=2)
    wide = ClosedLoopConfig(horizon=16, versions=3, actor="mlp", actor_hidden=32, seed=2)
    assert (
        run_closed_loop(narrow, BRACE(k=4), PPOClip()).value_pi
        != run_closed_loop(wide, BRACE(k=4), PPOClip()).value_pi
    )
    with pytest.raises(ValueError, match="actor_hidden must be >= 1; got 0"):
        ClosedLoopConfig(actor_hidden=0)
    with pytest.raises(ValueError, match="actor must be 'tabular' or 'mlp'; got 'lstm'"):
        ClosedLoopConfig(actor="lstm")  # type: ignore[arg-type]


@pytest.mark.parametrize("critic", ["tabular", "mlp"])
def test_shadow_critics_learn_from_the_same_data_without_touching_the_run(critic: str) -> None:
    from brace_lightning.closed_loop import ClosedLoopConfig, run_closed_loop
    from brace_lightning.objectives import PPOClip

    config = ClosedLoopConfig(
        horizon=16, versions=8, staleness=2, drift="gaussian", drift_kl=0.02, critic=critic,
        critic_lr=0.5 if critic == "tabular" else 0.01, seed=3,
    )  # fmt: skip
    plain = run_closed_loop(config, BRACE(k=4), PPOClip())
    shadowed = run_closed_loop(
        config, BRACE(k=4), PPOClip(), shadow_targets={"same": BRACE(k=4), "gae": GAE()}
    )
    assert shadowed.value_pi == plain.value_pi and shadowed.gap_pi == plain.gap_pi
    assert plain.shadow_gap_pi == {}
    # A shadow with the driving critic's target, kind and budget is that critic, version by
    # version — except the MLP, whose initial weights come from a later draw of the seeded RNG.
    if critic == "tabular":
        assert shadowed.shadow_gap_pi["same"] == plain.gap_pi
    assert len(shadowed.shadow_gap_pi["gae"]) == 8
    assert shadowed.shadow_gap_pi["gae"] != shadowed.shadow_gap_pi["same"]


def test_log_weight_statistics_match_a_float64_loop() -> None:
    from brace_lightning.closed_loop import log_weight_statistics

    generator = torch.Generator().manual_seed(0)
    log_w = torch.randn(5, 12, generator=generator, dtype=torch.float64) * 0.3
    mask = torch.ones(5, 12, dtype=torch.bool)
    mask[1, 9:] = False
    stats = log_weight_statistics(log_w, mask, c_bar=1.1, window=4)
    kept = sorted(abs(float(log_w[b, t])) for b in range(5) for t in range(12) if mask[b, t])
    assert stats["abs_mean"] == pytest.approx(sum(kept) / len(kept), abs=1e-12)
    assert stats["abs_max"] == kept[-1]
    assert len(kept) == 57 and stats["abs_p50"] == pytest.approx(kept[28], abs=1e-12)
    clipped = [[min(math.log(1.1), float(log_w[b, t])) if mask[b, t] else 0.0 for t in range(12)]
               for b in range(5)]  # fmt: skip
    products = [sum(row) for row in clipped]
    windows = [sum(row[t : t + 4]) for row in clipped for t in range(12 - 4 + 1)]
    assert stats["product_mean"] == pytest.approx(sum(products) / 5, abs=1e-12)
    assert stats["product_min"] == pytest.approx(min(products), abs=1e-12)
    assert stats["window_mean"] == pytest.approx(sum(windows) / len(windows), abs=1e-12)
    # A window longer than the row is the whole row.
    whole = log_weight_statistics(log_w, mask, c_bar=1.1, window=100)
    assert whole["window_mean"] == pytest.approx(whole["product_mean"], abs=1e-12)


def test_closed_loop_critic_warmup_and_equal_reward_rule_hold_the_actor() -> None:
    warm = _closed_loop(versions=8, critic_warmup_versions=3)
    assert warm.actor_stepped[:3] == [0.0, 0.0, 0.0]  # type: ignore[attr-defined]
    assert warm.value_pi[:4] == [warm.value_pi[0]] * 4  # type: ignore[attr-defined]
    assert warm.value_pi[4] != warm.value_pi[0]  # type: ignore[attr-defined]
    plain = _closed_loop(versions=8)
    assert plain.actor_stepped == [1.0] * 8  # type: ignore[attr-defined]
    # Horizon 2 with a batch of 4: batches whose 4 rewards are all equal happen often.
    rule = _closed_loop(horizon=2, batch_size=4, versions=40, skip_equal_reward_batches=True)
    off = _closed_loop(horizon=2, batch_size=4, versions=40)
    still = [v for v, s in enumerate(rule.actor_stepped) if s == 0.0]  # type: ignore[attr-defined]
    assert still and len(still) < 40
    assert rule.value_pi != off.value_pi  # type: ignore[attr-defined]
    for v in still:  # no actor step: the next version's policy is this one's
        if v + 1 < 40:
            assert rule.value_pi[v + 1] == rule.value_pi[v]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="critic_warmup_versions must be >= 0; got -1"):
        _closed_loop(critic_warmup_versions=-1)
