"""Issue 30's stability options and diagnostics (``docs/stability.md``).

- the equal-reward batch rule (``skip_equal_reward_batches``): a batch whose rewards are all equal
  leaves every actor weight unchanged and still trains the critic; a batch with two different
  rewards trains bit for bit as with the rule off; the count survives a checkpoint;
- the group rule (``mask_equal_reward_groups``): only the equal-reward groups' advantages change;
- the behaviour weights' effective sample size against a float64 loop, the length-capped fraction;
- decoupled PPO's truncation (``weight_cap``) and AReaL's masking (``weight_mask_above``) against a
  float64 loop, and the one-sentence error for a combination in which the cap never acts;
- the collapse warning on a fake metrics stream.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import pytest
import torch

from brace_lightning.callbacks import CollapseWarning, warning_positions
from brace_lightning.equal_rewards import (
    EqualRewards,
    equal_reward_group_fraction,
    equal_reward_groups,
    rewards_all_equal,
)
from brace_lightning.module import BraceModule
from brace_lightning.objectives import DecoupledPPO
from brace_lightning.objectives.functional import decoupled_ppo
from brace_lightning.ranks import whiten
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.step_metrics import effective_sample_size_fraction, step_statistics
from tests.test_kl_reference import fit_steps, fixed_batch, sgd_module, weights


def _with_scores(batch: RolloutBatch, scores: list[float]) -> RolloutBatch:
    return dataclasses.replace(batch, scores=torch.tensor(scores))


def _changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    after = weights(model)
    return any(not torch.equal(value, after[name]) for name, value in before.items())


# ---------------------------------------------------------------------- the batch rule


def test_all_equal_compares_over_every_rank() -> None:
    assert rewards_all_equal(torch.tensor([0.5, 0.5, 0.5]))
    assert not rewards_all_equal(torch.tensor([0.0, 0.0, 1e-6]))
    # This rank's rows are all 0; another rank holds a 1 (max 1, min 0): not equal.
    other_rank = torch.tensor([1.0, -0.0])
    assert not rewards_all_equal(torch.zeros(3), lambda x: torch.maximum(x, other_rank))
    assert rewards_all_equal(torch.zeros(3), lambda x: torch.maximum(x, torch.zeros(2)))


def test_an_equal_reward_batch_leaves_the_actor_and_still_trains_the_critic() -> None:
    batch = _with_scores(fixed_batch(), [0.0] * 6)  # a collapsed batch: every reward 0
    module = sgd_module(seed=0)
    actor, critic = weights(module.actor), weights(module.critic)
    metrics = fit_steps(module, batch, steps=2)
    assert not _changed(actor, module.actor)
    assert _changed(critic, module.critic)
    assert module.policy_version == 0 and module.rollout_step == 2
    assert metrics["actor/skipped_equal_reward"] == 1.0
    assert metrics["actor/skipped_equal_reward_total"] == 2.0
    assert metrics["rollout/equal_reward_group_fraction"] == 1.0
    assert "actor/loss" not in metrics and metrics["critic/loss"] > 0
    # The flag changes behaviour: with the rule off the same batch moves the actor.
    off = sgd_module(seed=0, skip_equal_reward_batches=False)
    fit_steps(off, batch, steps=1)
    assert _changed(actor, off.actor) and off.policy_version == 1


def test_a_batch_with_two_different_rewards_trains_bit_for_bit_as_without_the_rule() -> None:
    batch = _with_scores(fixed_batch(), [0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    runs = {}
    for rule in (True, False):
        module = sgd_module(seed=0, skip_equal_reward_batches=rule)
        metrics = fit_steps(module, batch, steps=2)
        runs[rule] = (weights(module.actor), weights(module.critic), metrics)
    for on, off in zip(runs[True][:2], runs[False][:2], strict=True):
        assert all(torch.equal(value, off[name]) for name, value in on.items())
    on_metrics, off_metrics = runs[True][2], runs[False][2]
    assert on_metrics["actor/skipped_equal_reward"] == 0.0
    assert on_metrics["actor/skipped_equal_reward_total"] == 0.0
    for name in ("actor/loss", "critic/loss", "actor/grad_norm", "kl/mu_pi_k3"):
        assert on_metrics[name] == off_metrics[name], name


def test_the_skip_count_is_the_due_steps_that_published_no_version() -> None:
    """Warm-up steps are not skips; a checkpoint restores rollout_step and policy_version, so the
    total counts on after a resume."""
    module = sgd_module(seed=0)
    module.critic_warmup_steps = 1
    metrics = fit_steps(module, _with_scores(fixed_batch(), [1.0] * 6), steps=3)
    assert metrics["actor/skipped_equal_reward_total"] == 2.0  # steps 1 and 2; step 0 warms up


def test_the_rule_flags_refuse_a_non_bool_in_one_sentence() -> None:
    with pytest.raises(
        ValueError, match=r"^skip_equal_reward_batches must be a bool; got 'yes'\.$"
    ):
        BraceModule(tiny_hidden_size=32, tiny_num_layers=1, skip_equal_reward_batches="yes")
    with pytest.raises(ValueError, match=r"^mask_equal_reward_groups must be a bool; got 1\.$"):
        EqualRewards(True, 1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the group rule


def test_equal_reward_groups_match_a_plain_loop() -> None:
    g = torch.Generator().manual_seed(0)
    group_ids = torch.randint(0, 7, (40,), generator=g) + 100
    scores = torch.randint(0, 2, (40,), generator=g).float()
    scores[group_ids == 103] = 0.25  # at least one group surely equal
    got = equal_reward_groups(scores, group_ids)
    groups: dict[int, list[float]] = {}
    for gid, score in zip(group_ids.tolist(), scores.tolist(), strict=True):
        groups.setdefault(gid, []).append(score)
    expected = [len(set(groups[gid])) == 1 for gid in group_ids.tolist()]
    assert got.tolist() == expected
    sized = [len(set(v)) == 1 for v in groups.values() if len(v) >= 2]
    assert equal_reward_group_fraction(scores, group_ids) == pytest.approx(sum(sized) / len(sized))
    assert math.isnan(equal_reward_group_fraction(scores[:3], torch.arange(3)))  # no group of two


def _advantages_of_step_one(module: BraceModule, batch: RolloutBatch) -> torch.Tensor:
    """The advantages the first rollout step's PPO epochs read."""
    seen: list[torch.Tensor] = []
    score = module._score

    def spy(*args: Any) -> Any:
        out = score(*args)
        seen.append(out[1].advantages.clone())
        return out

    module._score = spy  # type: ignore[method-assign]
    fit_steps(module, batch, steps=1)
    return seen[0]


def test_the_group_rule_zeroes_only_the_equal_groups_and_whitens_over_the_others() -> None:
    # groups (rows // 2): group 1's two rows are equal, groups 0 and 2 are not
    batch = _with_scores(fixed_batch(), [0.0, 1.0, 0.5, 0.5, 1.0, 0.0])
    raw = _advantages_of_step_one(sgd_module(seed=0, whiten_advantages=False), batch)
    masked_raw = _advantages_of_step_one(
        sgd_module(seed=0, whiten_advantages=False, mask_equal_reward_groups=True), batch
    )
    equal = torch.tensor([False, False, True, True, False, False])
    assert bool((masked_raw[equal] == 0).all()) and bool(raw[equal][batch.mask[equal]].ne(0).any())
    assert torch.equal(masked_raw[~equal], raw[~equal])
    whitened = _advantages_of_step_one(sgd_module(seed=0, mask_equal_reward_groups=True), batch)
    kept = batch.mask & ~equal[:, None]
    assert torch.equal(whitened, whiten(raw, kept))
    # Off (the default), or with no equal group, the advantages are the plain whitened ones.
    plain = _advantages_of_step_one(sgd_module(seed=0), batch)
    assert torch.equal(plain, whiten(raw, batch.mask))
    spread = _with_scores(batch, [0.0, 1.0, 0.5, 0.7, 1.0, 0.0])
    assert torch.equal(
        _advantages_of_step_one(sgd_module(seed=0, mask_equal_reward_groups=True), spread),
        _advantages_of_step_one(sgd_module(seed=0), spread),
    )


# ---------------------------------------------------------------------- diagnostics


def _slow_ess_fraction(weights: list[float]) -> float:
    return sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))


def test_effective_sample_size_matches_a_float64_loop_and_survives_huge_log_weights() -> None:
    g = torch.Generator().manual_seed(0)
    log_w = torch.randn(50, generator=g, dtype=torch.float64) * 2
    expected = _slow_ess_fraction([math.exp(x) for x in log_w.tolist()])
    assert effective_sample_size_fraction(log_w) == pytest.approx(expected, rel=1e-12)
    assert effective_sample_size_fraction(torch.zeros(7)) == pytest.approx(1.0)
    one_dominates = torch.tensor([0.0, 0.0, 0.0, 400.0])  # exp(400) overflows float64
    assert effective_sample_size_fraction(one_dominates) == pytest.approx(0.25)
    assert math.isnan(effective_sample_size_fraction(torch.zeros(0)))


def test_step_statistics_give_token_and_sequence_ess_and_the_length_capped_fraction() -> None:
    batch = fixed_batch()
    g = torch.Generator().manual_seed(1)
    proximal = batch.behavior_logprobs + torch.randn(batch.mask.shape, generator=g) * 0.5
    batch.info["truncated_fraction"] = 0.25
    zeros = torch.zeros(batch.mask.shape)
    metrics = step_statistics(batch, proximal, zeros, zeros)
    log_w = (proximal - batch.behavior_logprobs).double()
    tokens = [math.exp(x) for x in log_w[batch.mask].tolist()]
    sequences = [
        math.exp(sum(log_w[row][batch.mask[row]].tolist()))
        for row in range(len(batch))
        if batch.mask[row].any()
    ]
    assert metrics["weights/ess_fraction_tokens"] == pytest.approx(_slow_ess_fraction(tokens))
    assert metrics["weights/ess_fraction_sequences"] == pytest.approx(_slow_ess_fraction(sequences))
    assert metrics["weights/ess_fraction_sequences"] < metrics["weights/ess_fraction_tokens"]
    assert metrics["rollout/length_capped_fraction"] == 0.25
    # k3 KL(µ‖π) is the headline KL: nonnegative mean of w − 1 − log w
    w = log_w.exp()
    k3 = float((w - 1 - log_w)[batch.mask].mean())
    assert float(metrics["kl/mu_pi_k3"]) == pytest.approx(k3, rel=1e-5)
    del batch.info["truncated_fraction"]
    assert "rollout/length_capped_fraction" not in step_statistics(batch, proximal, zeros, zeros)


# ---------------------------------------------------------------------- truncation vs masking


def test_truncation_and_masking_of_the_behaviour_weight_match_a_float64_loop() -> None:
    g = torch.Generator().manual_seed(0)
    shape = (4, 9)
    mask = torch.rand(shape, generator=g) > 0.2
    logprobs = -torch.rand(shape, generator=g, dtype=torch.float64) * 2
    proximal = logprobs + torch.randn(shape, generator=g, dtype=torch.float64) * 0.1
    behavior = proximal - torch.randn(shape, generator=g, dtype=torch.float64)  # w of e^±2
    advantages = torch.randn(shape, generator=g, dtype=torch.float64)
    common = (logprobs, proximal, behavior, advantages, mask)
    truncated = decoupled_ppo(*common, weight_cap=2.0).token_loss
    masked = decoupled_ppo(*common, weight_mask_above=2.0).token_loss
    assert truncated.dtype == torch.float64
    above = 0
    for b in range(shape[0]):
        for t in range(shape[1]):
            if not mask[b, t]:
                assert truncated[b, t] == 0 and masked[b, t] == 0
                continue
            r = math.exp(float(logprobs[b, t] - proximal[b, t]))
            a = float(advantages[b, t])
            ppo = max(-r * a, -min(max(r, 0.8), 1.28) * a)
            w = math.exp(float(proximal[b, t] - behavior[b, t]))
            above += w > 2.0
            assert float(truncated[b, t]) == pytest.approx(min(w, 2.0) * ppo, rel=1e-12)
            assert float(masked[b, t]) == pytest.approx(0.0 if w > 2.0 else w * ppo, rel=1e-12)
    assert above > 0  # the two rules differ exactly on these tokens


def test_a_mask_threshold_at_or_below_the_cap_is_refused_in_one_sentence() -> None:
    with pytest.raises(ValueError, match=r"^weight_mask_above must be above weight_cap=2\.0 "):
        DecoupledPPO(weight_cap=2.0, weight_mask_above=2.0)
    DecoupledPPO(weight_cap=2.0, weight_mask_above=5.0)  # truncate at 2, drop above 5


# ---------------------------------------------------------------------- the collapse warning


class _FakeTrainer:
    """What CollapseWarning reads: the logged metrics, the rank, the stop flag."""

    def __init__(self) -> None:
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.is_global_zero = True
        self.should_stop = False
        self.global_step = 0


def _feed(callback: CollapseWarning, trainer: _FakeTrainer, stream: list[dict[str, float]]) -> None:
    for step, values in enumerate(stream, start=1):
        trainer.callback_metrics = {k: torch.tensor(v) for k, v in {**values, "step": step}.items()}
        callback.on_train_batch_end(trainer)  # type: ignore[arg-type]


def test_the_collapse_warning_fires_once_after_patience_steps_and_names_the_signal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    callback = CollapseWarning(patience=3)
    trainer = _FakeTrainer()
    groups = "rollout/equal_reward_group_fraction"
    stream = [{groups: 1.0}, {groups: 1.0}, {groups: 0.5}]  # broken run: no warning
    stream += [{groups: 1.0}] * 5 + [{"kl/mu_pi_k3": 0.01}]  # 3 in a row: one warning
    with caplog.at_level(logging.WARNING, logger="brace_lightning.callbacks"):
        _feed(callback, trainer, stream)
    assert len(callback.warnings) == 1 and len(caplog.records) == 1
    line = callback.warnings[0]
    assert line.startswith("Possible collapse at rollout step 6: the fraction of prompt groups")
    assert "rollout/equal_reward_group_fraction" in line and "try:" in line
    assert not trainer.should_stop and "\n" not in line
    # It warns again only after the signal dropped back.
    _feed(callback, trainer, [{groups: 0.0}] + [{groups: 1.0}] * 3)
    assert len(callback.warnings) == 2


def test_the_collapse_warning_watches_kl_and_length_cap_and_can_stop() -> None:
    callback = CollapseWarning(kl_threshold=0.05, length_cap_threshold=None, patience=2, stop=True)
    trainer = _FakeTrainer()
    capped = {"rollout/length_capped_fraction": 1.0}
    _feed(callback, trainer, [capped, capped, {"kl/mu_pi_k3": 0.06}])
    assert callback.warnings == [] and not trainer.should_stop  # length cap not watched
    _feed(callback, trainer, [{"kl/mu_pi_k3": 0.06}] * 2)
    assert len(callback.warnings) == 1 and "kl/mu_pi_k3" in callback.warnings[0]
    assert trainer.should_stop
    lengths = CollapseWarning(patience=2)
    _feed(lengths, _FakeTrainer(), [capped, capped])
    assert "max_new_tokens" in lengths.warnings[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"kl_threshold": -1.0},
            r"^kl_threshold must be None or a finite number >= 0; got -1\.0\.$",
        ),
        ({"patience": 0}, r"^patience must be an integer >= 1; got 0\.$"),
        ({"stop": "no"}, r"^stop must be a bool; got 'no'\.$"),
    ],
)
def test_the_collapse_warning_refuses_bad_arguments_in_one_sentence(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        CollapseWarning(**kwargs)


def test_the_replay_of_the_warning_rule_warns_where_the_callback_does() -> None:
    """warning_positions replays the callback's rule on a recorded series: it warns at the same
    steps as CollapseWarning fed the same values, and again only after the signal dropped back."""
    kl = [0.01, 0.03, 0.03, 0.02, 0.05, 0.05, 0.05, 0.05, 0.0, 0.04, 0.04, 0.04, 0.04]
    callback = CollapseWarning(kl_threshold=0.02, patience=3)
    trainer = _FakeTrainer()
    warned = []
    for position, value in enumerate(kl):
        _feed(callback, trainer, [{"kl/mu_pi_k3": value}])
        if len(callback.warnings) > len(warned):
            warned.append(position)
    assert warning_positions(kl, 0.02, 3) == warned == [6, 11]
    assert warning_positions(kl, 0.05, 1) == []  # strictly above the threshold
    assert warning_positions([], 0.02, 3) == []
