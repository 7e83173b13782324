"""Actor objectives and critic loss: against the float64 per-token references, hand-computed values,
identities (on-policy → −A), invariance to garbage at non-actions, extreme inputs, every flag, and
validation messages."""

from __future__ import annotations

import inspect
import itertools
import math

import docstring_parser
import pytest
import torch
from jsonargparse import ArgumentParser

from brace_lightning.objectives import (
    DIS,
    ESTR,
    PPOEWMA,
    TIS,
    ActorObjective,
    CriticLoss,
    DecoupledPPO,
    IcePop,
    KPop,
    ObjectiveOutput,
    PPOClip,
)
from brace_lightning.objectives import functional as F
from tests.support.reference_objectives import binary_kl as ref_binary_kl
from tests.support.reference_objectives import reference, reference_value_loss

RATIOS = (0.5, 0.85, 1.1, 1.5, 4.0)  # r = π_θ/π_prox: both sides of 0.8 / 1.28 and dual clip 3
WEIGHTS = (0.3, 0.8, 1.3, 3.0, 8.0)  # w = π_prox/µ: both sides of 0.5, 2, 5
PROBS = (0.05, 0.3, 0.6, 0.97)  # π_prox(y) scale, for KPop's probability-dependent band
ENTROPIES = (0.05, 0.5, 2.0)

KIND = {
    PPOClip: "ppo_clip",
    TIS: "tis",
    DecoupledPPO: "decoupled_ppo",
    PPOEWMA: "decoupled_ppo",
    IcePop: "icepop",
    KPop: "kpop",
    DIS: "dis",
    ESTR: "estr",
}

DEFAULTS = [cls() for cls in KIND]
CONFIGS = [
    *DEFAULTS,
    PPOClip(dual_clip=3.0),
    PPOClip(clip_low=0.1, clip_high=0.6, dual_clip=2.0),
    TIS(weight_cap=1.0, dual_clip=3.0),
    DecoupledPPO(weight_cap=2.0),
    DecoupledPPO(weight_mask_above=2.0),
    DecoupledPPO(weight_cap=1.0, weight_mask_above=5.0),
    PPOEWMA(ewma_decay=0.5, weight_cap=2.0),
    IcePop(alpha=0.9, beta=2.0),
    KPop(kl_threshold=0.01),
    DIS(eps_low=0.1, eps_high=0.6),
    ESTR(threshold=0.1, eps=0.1),
]


def _id(obj: object) -> str:
    return repr(obj)


def make_batch(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Every (r, w, sign of A) combination once: 50 actions in a [5, 13] batch with a prompt column,
    a hole (tool output) and padding; non-actions hold finite garbage."""
    tokens = list(itertools.product(RATIOS, WEIGHTS, (1.0, -1.0)))
    B, T = 5, 13
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        hole = 3 + b  # a non-action inside each row, at a different column per row
        cols = [t for t in range(1, T - 1) if t != hole]  # column 0 prompt, last column padding
        mask[b, cols] = True
    gen = torch.Generator().manual_seed(0)
    batch = {
        name: torch.randn(B, T, generator=gen, dtype=torch.float64) * 3
        for name in ("logprobs", "proximal_logprobs", "behavior_logprobs", "advantages")
    }
    batch["entropy"] = torch.rand(B, T, generator=gen, dtype=torch.float64)
    for i, (b, t) in enumerate(mask.nonzero().tolist()):
        r, w, sign = tokens[i]
        p = PROBS[i % len(PROBS)] * min(1.0, w)  # keeps µ(y) = p / w below 1
        batch["proximal_logprobs"][b, t] = math.log(p)
        batch["behavior_logprobs"][b, t] = math.log(p / w)
        batch["logprobs"][b, t] = math.log(p * r)
        batch["advantages"][b, t] = sign * (0.3 + 0.1 * (i % 7))
        batch["entropy"][b, t] = ENTROPIES[i % len(ENTROPIES)]
    out = {k: v.to(dtype) for k, v in batch.items()}
    out["mask"] = mask
    return out


def run(
    obj: ActorObjective, batch: dict[str, torch.Tensor]
) -> tuple[ObjectiveOutput, torch.Tensor]:
    """(output, d Σ token_loss / d logprobs)."""
    logprobs = batch["logprobs"].clone().requires_grad_()
    out = obj(**(batch | {"logprobs": logprobs}))
    (grad,) = torch.autograd.grad(out.token_loss.sum(), logprobs, allow_unused=True)
    return out, torch.zeros_like(logprobs) if grad is None else grad


def run_reference(
    obj: ActorObjective, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, int], torch.Tensor]:
    params = {k: v for k, v in vars(obj).items() if k != "ewma_decay"}
    logprobs = batch["logprobs"].clone().requires_grad_()
    names = ("proximal_logprobs", "behavior_logprobs", "advantages", "mask", "entropy")
    loss, counts = reference(KIND[type(obj)], logprobs, *(batch[n] for n in names), **params)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs, allow_unused=True)
    return loss, counts, torch.zeros_like(logprobs) if grad is None else grad


# ---------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("obj", CONFIGS, ids=_id)
def test_matches_reference(obj: ActorObjective) -> None:
    batch = make_batch()
    out, grad = run(obj, batch)
    ref_loss, ref_counts, ref_grad = run_reference(obj, batch)
    torch.testing.assert_close(out.token_loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    for key, value in ref_counts.items():
        if key in out.stats:
            assert out.stats[key].item() == value, key


def test_fixture_exercises_both_sides_of_every_threshold() -> None:
    """Guards the reference comparison above: each default rule keeps some actions and rejects
    others, and each PPO clip fires on some tokens and not on others."""
    batch = make_batch()
    n = int(batch["mask"].sum())
    for obj in (IcePop(), KPop(), DIS(), ESTR(), DecoupledPPO(weight_mask_above=2.0)):
        _, counts, _ = run_reference(obj, batch)
        assert 0 < counts["masked_count"] < n, obj
    _, counts, _ = run_reference(PPOClip(dual_clip=3.0), batch)
    for key in ("clip_low_count", "clip_high_count", "dual_clip_count"):
        assert 0 < counts[key] < n, key
    w = (batch["proximal_logprobs"] - batch["behavior_logprobs"]).exp()[batch["mask"]]
    assert (w > 2.0).any() and (w < 2.0).any()  # TIS truncation


def test_hand_computed_values() -> None:
    """Single tokens worked out by hand (r, w, A) → loss."""
    mask = torch.ones(1, 4, dtype=torch.bool)
    r = torch.tensor([[1.5, 0.5, 4.0, 1.1]], dtype=torch.float64)
    A = torch.tensor([[1.0, -1.0, -1.0, 2.0]], dtype=torch.float64)
    prox = torch.full((1, 4), math.log(0.2), dtype=torch.float64)
    lp = prox + r.log()
    # −min(1.5, 1.28), −min(−0.5, −0.8), −min(−4, −1.28), −min(2.2, 2.2)
    expected = torch.tensor([[-1.28, 0.8, 4.0, -2.2]], dtype=torch.float64)
    torch.testing.assert_close(F.ppo_clip(lp, prox, A, mask).token_loss, expected)
    expected[0, 2] = 3.0  # dual clip caps −A·r = 4 at −c·A = 3
    torch.testing.assert_close(F.ppo_clip(lp, prox, A, mask, dual_clip=3.0).token_loss, expected)

    w = torch.tensor([[3.0, 0.4, 1.0, 6.0]], dtype=torch.float64)
    behav = prox - w.log()
    base = torch.tensor([[-1.28, 0.8, 4.0, -2.2]], dtype=torch.float64)
    torch.testing.assert_close(F.decoupled_ppo(lp, prox, behav, A, mask).token_loss, w * base)
    torch.testing.assert_close(F.tis(lp, prox, behav, A, mask).token_loss, w.clamp(max=2.0) * base)
    keep = torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)  # w in [0.5, 5]
    torch.testing.assert_close(F.icepop(lp, prox, behav, A, mask).token_loss, keep * w * base)
    # DIS on ρ = π_θ/µ = r·w = [4.5, 0.2, 4.0, 6.6]: kept iff 0.7 < ρ < 6.
    rho = r * w
    expected_dis = torch.where(torch.tensor([[True, False, True, False]]), -rho * A, 0.0)
    torch.testing.assert_close(F.dis(lp, behav, A, mask).token_loss, expected_dis)


def test_kpop_and_estr_keep_rules_by_hand() -> None:
    """KPop needs both KL directions; ESTR's score scales with µ's entropy."""
    mask = torch.ones(1, 4, dtype=torch.bool)
    A = torch.ones(1, 4, dtype=torch.float64)
    # (p, q): KL(p‖q) = 0.071 but KL(q‖p) = 0.144 for (0.99, 0.9), and the reverse for (0.9, 0.99).
    p = torch.tensor([[0.99, 0.9, 0.5, 0.05]], dtype=torch.float64)
    q = torch.tensor([[0.9, 0.99, 0.45, 0.02]], dtype=torch.float64)
    out = F.kpop(p.log(), p.log(), q.log(), A, mask, kl_threshold=0.1)
    assert out.token_loss.tolist() == [[0.0, 0.0, -1.0, -1.0]]
    assert out.stats["masked_count"].item() == 2

    log_w = torch.tensor([[0.6, 0.8, 0.6, 0.5e-3]], dtype=torch.float64)  # log π_θ/µ
    entropy = torch.tensor([[0.5, 0.5, 0.2, -1e-6]], dtype=torch.float64)
    # scores 0.72, 1.28, 1.8, 0.25 (the slightly negative entropy counts as 0).
    prox = torch.full((1, 4), -1.0, dtype=torch.float64)
    out = F.estr(prox, prox, prox - log_w, entropy, A, mask)
    assert out.token_loss.tolist() == [[-1.0, 0.0, 0.0, -1.0]]
    expected_score = 0.36 / 0.5 + 0.64 / 0.5 + 0.36 / 0.2 + 0.25e-6 / 1e-6
    assert out.stats["score_sum"].item() == pytest.approx(expected_score, rel=1e-5)


def test_binary_kl_is_accurate_near_one_in_float32() -> None:
    """p = 1 − 1e-6, q = 1 − 1e-5: a naive 1 − exp(log p) in float32 loses every digit."""
    log_p = torch.tensor([math.log1p(-1e-6), 0.0, math.log(0.3)], dtype=torch.float32)
    log_q = torch.tensor([math.log1p(-1e-5), math.log(0.5), math.log(0.2)], dtype=torch.float32)
    kl = F.binary_kl(log_p, log_q)
    expected0 = (1 - 1e-6) * (math.log1p(-1e-6) - math.log1p(-1e-5)) + 1e-6 * math.log(0.1)
    assert kl[0].item() == pytest.approx(expected0, rel=1e-3)
    assert math.isfinite(kl[1].item()) and kl[1].item() > 0  # p = 1 exactly
    assert kl[2].item() == pytest.approx(ref_binary_kl(0.3, 0.2), rel=1e-5)


def test_stats_match_plain_sums() -> None:
    batch = make_batch()
    mask = batch["mask"]
    log_r = batch["logprobs"] - batch["proximal_logprobs"]
    w = (batch["proximal_logprobs"] - batch["behavior_logprobs"]).exp()
    out, _ = run(DecoupledPPO(weight_cap=2.0, weight_mask_above=5.0), batch)
    assert out.stats["ratio_sum"].item() == pytest.approx(log_r.exp()[mask].sum().item())
    k3 = log_r.exp() - 1 - log_r
    assert out.stats["approx_kl_sum"].item() == pytest.approx(k3[mask].sum().item())
    assert out.stats["weight_sum"].item() == pytest.approx(w[mask].sum().item())
    assert out.stats["weight_max"].item() == pytest.approx(8.0)
    assert out.stats["masked_count"].item() == int((w[mask] > 5.0).sum())
    assert out.stats["truncated_count"].item() == int(((w > 2.0) & (w <= 5.0))[mask].sum())
    rho = (batch["logprobs"] - batch["behavior_logprobs"]).exp()
    out, _ = run(DIS(), batch)
    assert out.stats["weight_sum"].item() == pytest.approx(rho[mask].sum().item())
    empty = {k: v[:, :1] for k, v in batch.items()}  # column 0 holds no action
    out, _ = run(IcePop(), empty)
    assert out.stats["weight_max"].item() == 0.0 and out.token_loss.abs().sum().item() == 0.0


@pytest.mark.parametrize("obj", CONFIGS, ids=_id)
def test_gradcheck(obj: ActorObjective) -> None:
    batch = make_batch()

    def loss(logprobs: torch.Tensor) -> torch.Tensor:
        return obj(**(batch | {"logprobs": logprobs})).token_loss

    assert torch.autograd.gradcheck(loss, batch["logprobs"].clone().requires_grad_())


# ---------------------------------------------------------------------- identities, robustness


@pytest.mark.parametrize("obj", CONFIGS, ids=_id)
def test_on_policy_reduces_to_minus_advantage(obj: ActorObjective) -> None:
    """µ = π_prox = π_θ: ratio 1 everywhere, no rule rejects, loss −A and gradient −A."""
    batch = make_batch()
    batch["proximal_logprobs"] = batch["behavior_logprobs"] = batch["logprobs"]
    out, grad = run(obj, batch)
    expected = torch.where(batch["mask"], -batch["advantages"], 0.0)
    torch.testing.assert_close(out.token_loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    assert out.stats.get("masked_count", torch.tensor(0.0)).item() == 0


@pytest.mark.parametrize("obj", CONFIGS, ids=_id)
@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf, 1e30])
def test_garbage_at_non_actions_changes_nothing(obj: ActorObjective, garbage: float) -> None:
    clean = make_batch()
    dirty = {
        k: v if k == "mask" else torch.where(clean["mask"], v, garbage) for k, v in clean.items()
    }
    out_clean, grad_clean = run(obj, clean)
    out_dirty, grad_dirty = run(obj, dirty)
    assert torch.equal(out_clean.token_loss, out_dirty.token_loss)
    assert torch.equal(grad_clean, grad_dirty)
    assert out_clean.stats.keys() == out_dirty.stats.keys()
    for key in out_clean.stats:
        assert torch.equal(out_clean.stats[key], out_dirty.stats[key]), key


@pytest.mark.parametrize("obj", CONFIGS, ids=_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_logprobs_give_finite_loss_and_gradient(
    obj: ActorObjective, dtype: torch.dtype
) -> None:
    values = (-50.0, -1e-8, 0.0, 50.0)
    combos = list(itertools.product(values, repeat=3))  # (logprobs, proximal, behavior)
    n = len(combos)
    batch = {
        name: torch.tensor([[c[i] for c in combos]], dtype=dtype)
        for i, name in enumerate(("logprobs", "proximal_logprobs", "behavior_logprobs"))
    }
    batch["advantages"] = torch.tensor([[(-1.0) ** i * 1e3 for i in range(n)]], dtype=dtype)
    batch["entropy"] = torch.tensor([[(0.0, 1e-9, 10.0)[i % 3] for i in range(n)]], dtype=dtype)
    batch["mask"] = torch.ones(1, n, dtype=torch.bool)
    out, grad = run(obj, batch)
    assert torch.isfinite(out.token_loss).all()
    assert torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in out.stats.values())


@pytest.mark.parametrize("obj", DEFAULTS, ids=_id)
def test_rows_are_independent(obj: ActorObjective) -> None:
    batch = make_batch()
    out, grad = run(obj, batch)
    for b in range(batch["mask"].shape[0]):
        row = {k: v[b : b + 1] for k, v in batch.items()}
        out_row, grad_row = run(obj, row)
        torch.testing.assert_close(out_row.token_loss, out.token_loss[b : b + 1])
        torch.testing.assert_close(grad_row, grad[b : b + 1])


@pytest.mark.parametrize("obj", DEFAULTS, ids=_id)
def test_float32_agrees_with_float64(obj: ActorObjective) -> None:
    out64, _ = run(obj, make_batch(torch.float64))
    out32, _ = run(obj, make_batch(torch.float32))
    assert out32.token_loss.dtype == torch.float32
    torch.testing.assert_close(out32.token_loss, out64.token_loss.float(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- every flag matters


def _loss(obj: ActorObjective, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return obj(**batch).token_loss


def _same_gap_and_across(quantities: torch.Tensor, base: float, lower: bool) -> tuple[float, float]:
    """Two thresholds past ``base`` on the rejecting side (below it if ``lower``): one still in the
    same gap between observed ``quantities`` (nothing crosses) and one past the next observed value
    (exactly one distinct value crosses)."""
    sign = -1.0 if lower else 1.0
    beyond: list[float] = []
    for v in sorted(v for v in (sign * quantities).tolist() if v > sign * base):
        if not beyond or v > beyond[-1] + 1e-6:  # equal up to rounding: one value
            beyond.append(v)
    same = (sign * base + beyond[0]) / 2
    across = (beyond[0] + beyond[1]) / 2 if len(beyond) > 1 else 2 * beyond[0] - sign * base
    return sign * same, sign * across


def _w(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["proximal_logprobs"] - batch["behavior_logprobs"]).exp()[batch["mask"]]


def _rho(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["logprobs"] - batch["behavior_logprobs"]).exp()[batch["mask"]]


def _kpop_kl(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    p, q = batch["proximal_logprobs"], batch["behavior_logprobs"]
    return torch.maximum(F.binary_kl(p, q), F.binary_kl(q, p))[batch["mask"]]


def _estr_score(batch: dict[str, torch.Tensor], eps: float = 1e-6) -> torch.Tensor:
    log_w = batch["logprobs"] - batch["behavior_logprobs"]
    return (log_w.square() / (batch["entropy"] + eps))[batch["mask"]]


# (class, argument, base threshold on the compared quantity, that quantity, whether it is a lower
# bound of the kept band, argument as a function of the threshold)
THRESHOLDS = [
    (DecoupledPPO, "weight_mask_above", 2.0, _w, False, lambda q: q),
    (IcePop, "alpha", 0.5, _w, True, lambda q: q),
    (IcePop, "beta", 5.0, _w, False, lambda q: q),
    (KPop, "kl_threshold", 0.1, _kpop_kl, False, lambda q: q),
    (ESTR, "threshold", 1.0, _estr_score, False, lambda q: q),
    (DIS, "eps_low", 0.7, _rho, True, lambda q: 1 - q),
    (DIS, "eps_high", 6.0, _rho, False, lambda q: q - 1),
]


@pytest.mark.parametrize(("cls", "arg", "base", "quantity", "lower", "to_arg"), THRESHOLDS)
def test_threshold_changes_loss_iff_a_token_crosses(
    cls, arg, base, quantity, lower, to_arg
) -> None:
    batch = make_batch()
    same, across = _same_gap_and_across(quantity(batch), base, lower)
    reference_loss = _loss(cls(**{arg: to_arg(base)}), batch)
    assert torch.equal(_loss(cls(**{arg: to_arg(same)}), batch), reference_loss)
    assert not torch.equal(_loss(cls(**{arg: to_arg(across)}), batch), reference_loss)


def test_clip_arguments_change_loss_only_off_policy() -> None:
    batch = make_batch()
    on_policy = batch | {"logprobs": batch["proximal_logprobs"]}
    base = PPOClip()
    for variant in (PPOClip(clip_low=0.1), PPOClip(clip_high=0.6), PPOClip(dual_clip=3.0)):
        assert not torch.equal(_loss(variant, batch), _loss(base, batch)), variant
        assert torch.equal(_loss(variant, on_policy), _loss(base, on_policy)), variant
    # max r is 4: a dual clip above it never binds.
    assert torch.equal(_loss(PPOClip(dual_clip=4.5), batch), _loss(base, batch))
    for cls in (TIS, DecoupledPPO, IcePop, KPop, ESTR):
        assert not torch.equal(_loss(cls(clip_high=0.6), batch), _loss(cls(), batch)), cls


def test_weight_caps() -> None:
    batch = make_batch()  # max w is 8
    uncapped = _loss(DecoupledPPO(), batch)
    assert not torch.equal(_loss(DecoupledPPO(weight_cap=2.0), batch), uncapped)
    assert torch.equal(_loss(DecoupledPPO(weight_cap=9.0), batch), uncapped)
    assert torch.equal(_loss(DecoupledPPO(weight_mask_above=9.0), batch), uncapped)
    assert torch.equal(_loss(TIS(weight_cap=9.0), batch), uncapped)
    assert not torch.equal(_loss(TIS(weight_cap=1.0), batch), _loss(TIS(), batch))
    # TIS is decoupled PPO with a cap and no mask.
    assert torch.equal(
        _loss(TIS(weight_cap=1.5), batch), _loss(DecoupledPPO(weight_cap=1.5), batch)
    )
    # Decoupled PPO always applies w: it differs from plain PPO off-policy.
    assert not torch.equal(uncapped, _loss(PPOClip(), batch))


def test_estr_eps_changes_loss_only_when_a_token_crosses() -> None:
    batch = make_batch()  # entropies are at least 0.05, so 1e-6 → 1e-7 moves no score across 1
    base = _loss(ESTR(), batch)
    assert torch.equal(_loss(ESTR(eps=1e-7), batch), base)
    assert ((_estr_score(batch, 1e-6) > 1.0) != (_estr_score(batch, 1.0) > 1.0)).any()
    assert not torch.equal(_loss(ESTR(eps=1.0), batch), base)


def test_ppo_ewma_is_decoupled_ppo_with_an_ewma_flag() -> None:
    batch = make_batch()
    ewma = PPOEWMA(ewma_decay=0.95, weight_mask_above=4.0)
    assert ewma.ewma_decay == 0.95
    assert torch.equal(_loss(ewma, batch), _loss(DecoupledPPO(weight_mask_above=4.0), batch))
    assert all(obj.ewma_decay is None for obj in DEFAULTS if not isinstance(obj, PPOEWMA))
    assert [type(obj) for obj in DEFAULTS if obj.needs_entropy] == [ESTR]


# ---------------------------------------------------------------------- critic


def make_critic_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(4, 9, generator=gen) < 0.7
    old = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    # V − V_old on both sides of ±0.5, returns on both sides of V.
    values = old + torch.linspace(-1.3, 1.3, 36, dtype=torch.float64).reshape(4, 9)
    returns = old + torch.randn(4, 9, generator=gen, dtype=torch.float64)
    return {"values": values, "old_values": old, "returns": returns, "mask": mask}


@pytest.mark.parametrize("clip", [0.5, 0.2, None])
def test_critic_matches_reference(clip: float | None) -> None:
    batch = make_critic_batch()
    values = batch["values"].clone().requires_grad_()
    out = CriticLoss(clip=clip)(**(batch | {"values": values}))
    (grad,) = torch.autograd.grad(out.token_loss.sum(), values)
    ref_values = batch["values"].clone().requires_grad_()
    names = ("old_values", "returns", "mask")
    ref, ref_count = reference_value_loss(ref_values, *(batch[n] for n in names), clip)
    (ref_grad,) = torch.autograd.grad(ref.sum(), ref_values)
    torch.testing.assert_close(out.token_loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert out.stats["value_clip_count"].item() == ref_count
    if clip is not None:
        assert 0 < ref_count < int(batch["mask"].sum())
    error = (batch["values"] - batch["returns"]).square()[batch["mask"]].sum()
    assert out.stats["squared_error_sum"].item() == pytest.approx(error.item())
    assert torch.autograd.gradcheck(
        lambda v: CriticLoss(clip=clip)(**(batch | {"values": v})).token_loss,
        batch["values"].clone().requires_grad_(),
    )


def test_critic_hand_computed_and_clip_flag() -> None:
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.zeros(1, 3, dtype=torch.float64)
    values = torch.tensor([[1.0, 0.2, -1.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 0.0, 1.0]], dtype=torch.float64)
    inputs = {"values": values, "old_values": old, "returns": returns, "mask": mask}
    # Clipped values [0.5, 0.2, −0.5]: ½ max(1, 2.25), ½ 0.04, ½ max(4, 2.25).
    expected = torch.tensor([[1.125, 0.02, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(CriticLoss()(**inputs).token_loss, expected)
    plain = 0.5 * (values - returns).square()
    torch.testing.assert_close(CriticLoss(clip=None)(**inputs).token_loss, plain)
    torch.testing.assert_close(CriticLoss(clip=5.0)(**inputs).token_loss, plain)


def test_critic_garbage_and_extremes() -> None:
    batch = make_critic_batch()
    dirty = {
        k: v if k == "mask" else torch.where(batch["mask"], v, math.nan) for k, v in batch.items()
    }
    for b in (batch, dirty):
        b["values"] = b["values"].clone().requires_grad_()
    clean_out, dirty_out = CriticLoss()(**batch), CriticLoss()(**dirty)
    assert torch.equal(clean_out.token_loss, dirty_out.token_loss)
    (g_clean,) = torch.autograd.grad(clean_out.token_loss.sum(), batch["values"])
    (g_dirty,) = torch.autograd.grad(dirty_out.token_loss.sum(), dirty["values"])
    assert torch.equal(g_clean, g_dirty)


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (lambda: PPOClip(clip_low=1.5), "clip_low"),
        (lambda: PPOClip(clip_low=0.0), "clip_low"),
        (lambda: PPOClip(clip_high=-0.1), "clip_high"),
        (lambda: PPOClip(clip_high=math.nan), "clip_high"),
        (lambda: PPOClip(dual_clip=1.0), "dual_clip"),
        (lambda: TIS(weight_cap=0.0), "weight_cap"),
        (lambda: DecoupledPPO(weight_cap=-1.0), "weight_cap"),
        (lambda: DecoupledPPO(weight_mask_above=math.inf), "weight_mask_above"),
        (lambda: PPOEWMA(ewma_decay=1.0), "ewma_decay"),
        (lambda: PPOEWMA(ewma_decay=0.0), "ewma_decay"),
        (lambda: IcePop(alpha=1.5), "alpha"),
        (lambda: IcePop(beta=0.9), "beta"),
        (lambda: KPop(kl_threshold=0.0), "kl_threshold"),
        (lambda: DIS(eps_low=1.2), "eps_low"),
        (lambda: DIS(eps_high=0.0), "eps_high"),
        (lambda: ESTR(threshold=-1.0), "threshold"),
        (lambda: ESTR(eps=0.0), "eps"),
        (lambda: ESTR(clip_low=True), "clip_low"),
        (lambda: CriticLoss(clip=0.0), "clip"),
    ],
)
def test_bad_hyperparameters_raise_one_sentence_naming_them(make, arg: str) -> None:
    with pytest.raises(ValueError, match=rf"^{arg} must be .*; got .*\.$"):
        make()


def test_bad_inputs_raise_naming_the_argument() -> None:
    batch = make_batch()
    with pytest.raises(ValueError, match="^entropy must"):
        ESTR()(**(batch | {"entropy": None}))
    with pytest.raises(ValueError, match="^mask must be a torch.bool"):
        PPOClip()(**(batch | {"mask": batch["mask"].float()}))
    with pytest.raises(ValueError, match="^advantages has shape"):
        PPOClip()(**(batch | {"advantages": batch["advantages"][:, 1:]}))
    nan_at_action = batch["behavior_logprobs"].clone()
    nan_at_action[batch["mask"].nonzero()[0].tolist()] = math.nan
    with pytest.raises(ValueError, match="^behavior_logprobs has non-finite values at action"):
        IcePop()(**(batch | {"behavior_logprobs": nan_at_action}))
    with pytest.raises(ValueError, match="^returns has non-finite"):
        CriticLoss()(
            values=batch["logprobs"],
            old_values=batch["logprobs"],
            returns=torch.where(batch["mask"], math.inf, 0.0),
            mask=batch["mask"],
        )


# ---------------------------------------------------------------------- configuration


@pytest.mark.parametrize("cls", [*KIND, CriticLoss], ids=lambda c: c.__name__)
def test_every_init_argument_is_typed_documented_and_keyword_only(cls: type) -> None:
    """LightningCLI builds ``--help`` from these docstrings and annotations."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    documented = {p.arg_name for p in docstring_parser.parse(cls.__doc__).params}
    assert {p.name for p in params} == documented
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    assert all(p.annotation is not inspect.Parameter.empty for p in params)


def test_yaml_class_path_selects_the_objective() -> None:
    parser = ArgumentParser()
    parser.add_argument("--objective", type=ActorObjective, default=None)
    parser.add_argument("--critic_loss", type=CriticLoss, default=None)
    cfg = parser.parse_string(
        "objective:\n"
        "  class_path: brace_lightning.objectives.PPOEWMA\n"
        "  init_args: {ewma_decay: 0.8, weight_cap: 3.0}\n"
        "critic_loss:\n"
        "  init_args: {clip: null}\n"
    )
    init = parser.instantiate(cfg)
    assert isinstance(init.objective, PPOEWMA)
    assert (init.objective.ewma_decay, init.objective.weight_cap) == (0.8, 3.0)
    assert init.critic_loss.clip is None
    for cls in KIND:
        cfg = parser.parse_string(
            f"objective:\n  class_path: brace_lightning.objectives.{cls.__name__}"
        )
        assert type(parser.instantiate(cfg).objective) is cls
