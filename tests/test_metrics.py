"""Metrics of :mod:`brace_lightning.metrics` against plain loops, and their exact merging."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from brace_lightning.metrics import (
    HorizonBeta,
    ImportanceWeightStats,
    SeparationByPosition,
    SignedValueBias,
    StalenessHistogram,
    ValueBiasGap,
    ValueSquaredError,
    critic_scores,
    power_of_two_edges,
)
from brace_lightning.metrics.functional import (
    action_index,
    bin_index,
    remaining_horizon,
    reward_to_go,
)


def _batch(seed: int, rows: int = 6, columns: int = 20) -> dict[str, torch.Tensor]:
    """Rows with a left-padded prompt, actions with holes (tool output), right padding."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, columns, generator=generator) < 0.7
    mask[:, :2] = False
    mask[0] = False  # a row with no action
    mask[1, -5:] = False
    out = {"mask": mask}
    for name in ("a", "b", "c"):
        out[name] = torch.randn(rows, columns, generator=generator, dtype=torch.float64)
        out[name][~mask] = math.nan  # garbage at non-actions must be ignored
    return out


def _action_lists(mask: torch.Tensor) -> list[list[int]]:
    return [[t for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]


def _bin(x: int, edges: tuple[int, ...]) -> int:
    index = -1
    for i, edge in enumerate(edges):
        if x >= edge:
            index = i
    return index


# --------------------------------------------------------------------------- functional


@given(seed=st.integers(0, 10_000), gamma=st.sampled_from([1.0, 0.9, 0.5, 0.0]))
@settings(max_examples=25, deadline=None)
def test_functional_matches_a_loop(seed: int, gamma: float) -> None:
    batch = _batch(seed)
    mask, rewards = batch["mask"], batch["a"]
    index, remaining = action_index(mask), remaining_horizon(mask)
    returns = reward_to_go(rewards, mask, gamma=gamma)
    for b, actions in enumerate(_action_lists(mask)):
        for n, t in enumerate(actions):
            assert index[b, t] == n
            assert remaining[b, t] == len(actions) - n
            expected = sum(
                gamma ** (m - n) * rewards[b, u].item() for m, u in enumerate(actions) if m >= n
            )
            assert returns[b, t].item() == pytest.approx(expected, abs=1e-10)
    for out in (index, remaining, returns):
        assert bool((out[~mask] == 0).all())


def test_reward_to_go_is_the_terminal_reward_with_gamma_one() -> None:
    mask = torch.tensor([[False, True, True, False, True, False]])
    rewards = torch.tensor([[5.0, 0.0, 0.0, 7.0, 1.5, 9.0]])  # 5, 7, 9 sit at non-actions
    expected = torch.tensor([[0.0, 1.5, 1.5, 0.0, 1.5, 0.0]])
    assert torch.equal(reward_to_go(rewards, mask), expected)


def test_bin_index_uses_left_edges_and_an_open_last_bin() -> None:
    edges = torch.tensor([1, 2, 4, 8])
    x = torch.tensor([0, 1, 2, 3, 4, 7, 8, 1000])
    assert bin_index(x, edges).tolist() == [-1, 0, 1, 1, 2, 2, 3, 3]
    assert power_of_two_edges(8) == (0, 1, 2, 4, 8)
    assert power_of_two_edges(8, start=1) == (1, 2, 4, 8)
    assert power_of_two_edges(10, start=3) == (3, 4, 8)


def test_functional_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="mask must be a torch.bool"):
        action_index(torch.ones(2, 3))
    with pytest.raises(ValueError, match="rewards has shape"):
        reward_to_go(torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="gamma"):
        reward_to_go(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), gamma=1.5)
    with pytest.raises(ValueError, match="non-finite"):
        reward_to_go(torch.full((2, 3), math.nan), torch.ones(2, 3, dtype=torch.bool))


# --------------------------------------------------------------------------- critic metrics


def test_value_bias_gap_is_the_mean_absolute_gap_over_actions() -> None:
    batch = _batch(0)
    mask = batch["mask"]
    metric = ValueBiasGap()
    metric.update(batch["a"], batch["b"], mask)
    expected = (batch["a"] - batch["b"])[mask].abs().mean()
    assert metric.compute().item() == pytest.approx(expected.item(), abs=1e-12)
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(ValueBiasGap().compute().item())


def test_critic_scores_match_a_float64_loop_over_actions() -> None:
    edges = (0, 2, 5, 9)
    scores = critic_scores(edges, prefix="val/")
    batches = [_batch(seed) for seed in (4, 5)]
    for batch in batches:
        scores.update(batch["a"].float(), batch["b"], batch["mask"])
    result = {name: value.item() for name, value in scores.compute().items()}
    square = absolute = signed = 0.0
    count = 0
    bins = [[0.0, 0] for _ in edges]
    for batch in batches:
        for b, actions in enumerate(_action_lists(batch["mask"])):
            for n, t in enumerate(actions):
                diff = float(batch["a"][b, t].float().double()) - float(batch["b"][b, t])
                square, absolute, signed, count = (
                    square + diff * diff,
                    absolute + abs(diff),
                    signed + diff,
                    count + 1,
                )
                bins[_bin(n, edges)][0] += diff
                bins[_bin(n, edges)][1] += 1
    names = ["val/value_bias_pos0_2", "val/value_bias_pos2_5", "val/value_bias_pos5_9"]
    names.append("val/value_bias_pos9_up")
    assert sorted(result) == sorted(
        ["val/value_mse_mc", "val/value_abs_error_mc", "val/value_bias_mc", *names]
    )
    assert result["val/value_mse_mc"] == pytest.approx(square / count, abs=1e-12)
    assert result["val/value_abs_error_mc"] == pytest.approx(absolute / count, abs=1e-12)
    assert result["val/value_bias_mc"] == pytest.approx(signed / count, abs=1e-12)
    for name, (total, n) in zip(names, bins, strict=True):
        assert n > 0
        assert result[name] == pytest.approx(total / n, abs=1e-12)


def test_critic_score_bins_keep_their_own_state_and_empty_bins_are_nan() -> None:
    # Both late bins are empty after the first batch; a shared compute group would merge them.
    scores = critic_scores((0, 4, 8))
    mask = torch.ones(1, 3, dtype=torch.bool)
    scores.update(torch.zeros(1, 3), torch.ones(1, 3), mask)
    scores.update(torch.zeros(1, 10), torch.cat([torch.ones(1, 6), torch.full((1, 4), 3.0)], 1),
                  torch.ones(1, 10, dtype=torch.bool))  # fmt: skip
    result = scores.compute()
    assert result["value_bias_pos0_4"].item() == -1.0
    assert result["value_bias_pos4_8"].item() == pytest.approx(-(1 + 1 + 3 + 3) / 4)
    assert result["value_bias_pos8_up"].item() == -3.0
    empty = critic_scores((0, 100))
    empty.update(torch.zeros(1, 3), torch.ones(1, 3), mask)
    assert math.isnan(empty.compute()["value_bias_pos100_up"].item())


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_squared_error_is_minimised_by_the_true_value_and_absolute_error_is_not(p: float) -> None:
    # G ~ Bernoulli(p) exactly: 100 rows whose returns are 1 in round(100 p) of them, so the metric
    # over the rows *is* the expectation E[score(V, G)] for a constant critic V.
    returns = (torch.arange(100) < round(100 * p)).double()[:, None]
    mask = torch.ones(100, 1, dtype=torch.bool)
    grid = [i / 100 for i in range(101)]
    mse, mae = [], []
    for v in grid:
        values = torch.full((100, 1), v, dtype=torch.float64)
        squared, absolute = ValueSquaredError(), ValueBiasGap()
        squared.update(values, returns, mask)
        absolute.update(values, returns, mask)
        mse.append(squared.compute().item())
        mae.append(absolute.compute().item())
        # E(V − G)² = Var G + (V − p)²; E|V − G| = p + V(1 − 2p).
        assert mse[-1] == pytest.approx(p * (1 - p) + (v - p) ** 2, abs=1e-12)
        assert mae[-1] == pytest.approx(p + v * (1 - 2 * p), abs=1e-12)
    assert grid[min(range(101), key=mse.__getitem__)] == pytest.approx(p)
    best_mae = grid[min(range(101), key=mae.__getitem__)]
    assert best_mae in (0.0, 1.0) or p == 0.5  # the median: 0 or 1, never p (a tie at p = 1/2)
    if p != 0.5:
        assert best_mae != pytest.approx(p)


def test_signed_value_bias_rejects_bad_bins() -> None:
    with pytest.raises(ValueError, match="start must be an int >= 0; got -1"):
        SignedValueBias(-1)
    with pytest.raises(ValueError, match="stop must be None or an int > start = 4; got 4"):
        SignedValueBias(4, 4)


def test_separation_by_position_bins_the_mean_difference() -> None:
    batch = _batch(1)
    mask, diff = batch["mask"], batch["a"]
    edges = (0, 2, 5, 9)
    metric = SeparationByPosition(edges)
    metric.update(diff, mask)
    result = metric.compute()
    sums, counts = [0.0] * len(edges), [0] * len(edges)
    for b, actions in enumerate(_action_lists(mask)):
        for n, t in enumerate(actions):
            i = _bin(n, edges)
            sums[i] += diff[b, t].item()
            counts[i] += 1
    assert result.count.tolist() == counts
    for i in range(len(edges)):
        assert result.defined[i] == (counts[i] > 0)
        expected = sums[i] / counts[i] if counts[i] else 0.0
        assert result.value[i].item() == pytest.approx(expected, abs=1e-12)
    assert result.edges.tolist() == list(edges)


def test_separation_reports_empty_bins_as_undefined_zeros() -> None:
    metric = SeparationByPosition((0, 4, 100))
    metric.update(torch.ones(2, 5), torch.ones(2, 5, dtype=torch.bool))
    result = metric.compute()
    assert result.value.tolist() == [1.0, 1.0, 0.0]
    assert result.defined.tolist() == [True, True, False]
    assert result.count.tolist() == [8, 2, 0]


def test_horizon_beta_is_the_least_squares_slope_per_bin() -> None:
    generator = torch.Generator().manual_seed(2)
    mask = torch.rand(64, 30, generator=generator) < 0.8
    x = torch.randn(64, 30, generator=generator, dtype=torch.float64)
    remaining = remaining_horizon(mask)
    slope_by_horizon = 1.0 / remaining.clamp(min=1).double()
    y = slope_by_horizon * x + 0.1 * torch.randn(64, 30, generator=generator, dtype=torch.float64)
    edges = (1, 2, 4, 8, 16)
    metric = HorizonBeta(edges)
    metric.update(y, x, mask)
    result = metric.compute()
    bins = bin_index(remaining, torch.tensor(edges))
    for i in range(len(edges)):
        keep = mask & (bins == i)
        xs, ys = x[keep], y[keep]
        reference = ((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum()
        assert result.value[i].item() == pytest.approx(reference.item(), rel=1e-9)
        assert result.count[i].item() == int(keep.sum())
    assert bool(result.defined.all())
    assert result.value[0].item() == pytest.approx(1.0, abs=0.05)  # h = 1: slope 1/1


def test_horizon_beta_without_spread_is_undefined() -> None:
    mask = torch.ones(4, 3, dtype=torch.bool)
    returns = torch.ones(4, 3)  # every row succeeded: no spread in x
    metric = HorizonBeta((1, 2, 3, 10))
    metric.update(torch.rand(4, 3), returns, mask)
    result = metric.compute()
    assert result.defined.tolist() == [False, False, False, False]
    assert result.value.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert result.count.tolist() == [4, 4, 4, 0]
    assert not torch.isnan(result.value).any()


@pytest.mark.parametrize("edges", [(), (2, 1), (0, 0), (-1, 3), (1.5, 2)])
def test_binned_metrics_validate_their_edges(edges: tuple) -> None:
    for cls in (SeparationByPosition, HorizonBeta):
        with pytest.raises(ValueError, match="bin_edges"):
            cls(edges)


# --------------------------------------------------------------------------- rollout metrics


def test_importance_weight_stats_match_direct_computation() -> None:
    generator = torch.Generator().manual_seed(3)
    mask = torch.rand(50, 40, generator=generator) < 0.9
    behavior = -torch.rand(50, 40, generator=generator, dtype=torch.float64) * 3
    target = behavior + 0.3 * torch.randn(50, 40, generator=generator, dtype=torch.float64)
    metric = ImportanceWeightStats(rho_bar=1.2, c_bar=1.1, quantiles=(0.05, 0.5, 0.95))
    metric.update(target, behavior, mask)
    out = metric.compute()
    log_w = (target - behavior)[mask]
    w = log_w.exp()
    assert out["log_w_mean"].item() == pytest.approx(log_w.mean().item(), rel=1e-12)
    assert out["w_mean"].item() == pytest.approx(w.mean().item(), rel=1e-12)
    ess = w.sum() ** 2 / (w.numel() * (w * w).sum())
    assert out["ess"].item() == pytest.approx(ess.item(), rel=1e-12)
    assert out["clip_fraction_rho"].item() == pytest.approx((w > 1.2).double().mean().item())
    assert out["clip_fraction_c"].item() == pytest.approx((w > 1.1).double().mean().item())
    resolution = 8.0 / 4000
    for q in (0.05, 0.5, 0.95):
        exact = torch.quantile(log_w, q).item()
        assert out[f"log_w_q{q:g}"].item() == pytest.approx(exact, abs=resolution)


def test_importance_weight_quantiles_interpolate_inside_a_bin() -> None:
    metric = ImportanceWeightStats(quantiles=(0.25, 0.5, 0.75), log_w_range=(0.0, 4.0), num_bins=4)
    log_w = torch.tensor([[0.5, 1.5, 1.5, 2.5]])  # one in [0, 1), two in [1, 2), one in [2, 3)
    metric.update(log_w, torch.zeros_like(log_w), torch.ones_like(log_w, dtype=torch.bool))
    out = metric.compute()
    assert out["log_w_q0.25"].item() == pytest.approx(1.0)  # the first bin's mass ends at 1
    assert out["log_w_q0.5"].item() == pytest.approx(1.5)  # halfway through [1, 2)
    assert out["log_w_q0.75"].item() == pytest.approx(2.0)


def test_importance_weight_quantiles_outside_the_range_saturate() -> None:
    metric = ImportanceWeightStats(quantiles=(0.1, 0.9), log_w_range=(-1.0, 1.0), num_bins=10)
    log_w = torch.tensor([[-5.0, -5.0, 0.05, 5.0, 5.0]])
    metric.update(log_w, torch.zeros_like(log_w), torch.ones_like(log_w, dtype=torch.bool))
    out = metric.compute()
    assert out["log_w_q0.1"].item() == -1.0
    assert out["log_w_q0.9"].item() == 1.0


def test_importance_weight_flags_change_the_output() -> None:
    log_w = torch.tensor([[0.0, 0.05, 0.15, 0.3]])
    inputs = (log_w, torch.zeros_like(log_w), torch.ones_like(log_w, dtype=torch.bool))
    loose, tight = ImportanceWeightStats(rho_bar=2.0, c_bar=2.0), ImportanceWeightStats()
    loose.update(*inputs)
    tight.update(*inputs)
    assert loose.compute()["clip_fraction_rho"].item() == 0.0
    assert tight.compute()["clip_fraction_rho"].item() == 0.25  # exp(0.3) > 1.2
    assert tight.compute()["clip_fraction_c"].item() == 0.5  # exp(0.15), exp(0.3) > 1.1
    with pytest.raises(ValueError, match="rho_bar"):
        ImportanceWeightStats(rho_bar=0.0)
    with pytest.raises(ValueError, match="quantiles"):
        ImportanceWeightStats(quantiles=(1.0,))
    with pytest.raises(ValueError, match="log_w_range"):
        ImportanceWeightStats(log_w_range=(1.0, -1.0))


def test_staleness_histogram_per_sample_and_per_token() -> None:
    versions = torch.tensor(
        [
            [-1, 3, 3, 4, -1],  # sampled across an update: oldest version 3
            [-1, 5, 5, -1, -1],
            [-1, -1, -1, -1, -1],  # no action: skipped
            [-1, 0, 1, 1, 1],
        ]
    )
    mask = versions >= 0
    per_sample = StalenessHistogram(max_bucket=3)
    per_sample.update(versions, mask, trainer_version=5)
    counts, mean, largest = per_sample.compute()
    assert counts.tolist() == [1, 0, 1, 1]  # gaps 2, 0, 5 (5 lands in the last bucket)
    assert mean.item() == pytest.approx(7 / 3)
    assert largest.item() == 5
    per_token = StalenessHistogram(max_bucket=3, per_token=True)
    per_token.update(versions, mask, trainer_version=5)
    counts, mean, largest = per_token.compute()
    gaps = [2, 2, 1, 0, 0, 5, 4, 4, 4]
    assert counts.tolist() == [2, 1, 2, 4]
    assert mean.item() == pytest.approx(sum(gaps) / len(gaps))
    assert largest.item() == 5


def test_staleness_histogram_rejects_bad_inputs() -> None:
    metric = StalenessHistogram()
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="trainer_version=1"):
        metric.update(torch.tensor([[0, 2]]), mask, trainer_version=1)
    with pytest.raises(ValueError, match="versions must be an integer"):
        metric.update(torch.zeros(1, 2), mask, trainer_version=1)
    with pytest.raises(ValueError, match="max_bucket"):
        StalenessHistogram(max_bucket=-1)
    with pytest.raises(ValueError, match=r"^per_token must be a bool; got 1\.$"):
        StalenessHistogram(per_token=1)
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(StalenessHistogram().compute().mean.item())


# --------------------------------------------------------------------------- distributed reduction


def _updates(seed: int) -> dict[str, tuple]:
    batch = _batch(seed, rows=8, columns=24)
    mask = batch["mask"]
    versions = torch.where(mask, torch.randint(0, 6, mask.shape), -1)
    return {
        "ValueBiasGap": (batch["a"], batch["b"], mask),
        "ValueSquaredError": (batch["a"], batch["b"], mask),
        "SignedValueBias": (batch["a"], batch["b"], mask),
        "SeparationByPosition": (batch["a"], mask),
        "HorizonBeta": (batch["a"], batch["b"], mask),
        "ImportanceWeightStats": (batch["a"], batch["b"], mask),
        "StalenessHistogram": (versions, mask, 7),
    }


def _make(name: str) -> object:
    return {
        "ValueBiasGap": lambda: ValueBiasGap(),
        "ValueSquaredError": lambda: ValueSquaredError(),
        "SignedValueBias": lambda: SignedValueBias(3, 9),
        "SeparationByPosition": lambda: SeparationByPosition((0, 3, 9)),
        "HorizonBeta": lambda: HorizonBeta((1, 4, 10)),
        "ImportanceWeightStats": lambda: ImportanceWeightStats(),
        "StalenessHistogram": lambda: StalenessHistogram(max_bucket=4),
    }[name]()


def _flatten(result: object) -> list[float]:
    if isinstance(result, dict):
        return [v for key in sorted(result) for v in _flatten(result[key])]
    if isinstance(result, tuple):
        return [v for item in result for v in _flatten(item)]
    return torch.as_tensor(result).double().reshape(-1).tolist()


@pytest.mark.parametrize(
    "name",
    [
        "ValueBiasGap",
        "ValueSquaredError",
        "SignedValueBias",
        "SeparationByPosition",
        "HorizonBeta",
        "ImportanceWeightStats",
        "StalenessHistogram",
    ],
)
def test_metrics_merged_from_shards_equal_one_metric_on_everything(name: str) -> None:
    whole, left, right = _make(name), _make(name), _make(name)
    shards = [_updates(seed)[name] for seed in range(4)]
    for i, args in enumerate(shards):
        whole.update(*args)
        (left if i % 2 else right).update(*args)
    left.merge_state(right)
    # Sums merged in a different order: equal up to float rounding.
    assert _flatten(left.compute()) == pytest.approx(
        _flatten(whole.compute()), rel=1e-12, abs=1e-12
    )


def test_metrics_reject_shape_mismatches() -> None:
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="reference has shape"):
        ValueBiasGap().update(torch.zeros(2, 3), torch.zeros(3, 2), mask)
    with pytest.raises(ValueError, match="diff has shape"):
        SeparationByPosition().update(torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match="realized_returns"):
        HorizonBeta().update(torch.zeros(2, 3), torch.full((2, 3), math.inf), mask)
