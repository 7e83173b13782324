"""BraceModule as a unit: the training step's shape, its parts (Scored, UpdateStats, Scorer, the
EWMA and reference copies, the rank reductions with one process) and what one step trains.

End-to-end runs of the module live in test_trainer.py (CLI), test_kl_reference.py (the KL term),
test_objectives_trainer.py (objectives, EWMA), test_packing.py (packed = padded) and
test_recorded_runs.py (bit-identical recorded runs).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from brace_lightning import module as module_file
from brace_lightning.models.copies import (
    LEGACY_PREFIXES,
    EwmaPolicy,
    ReferencePolicy,
    upgrade_checkpoint_keys,
)
from brace_lightning.models.policy import position_ids_from_attention_mask, token_logprobs
from brace_lightning.module import BraceModule, shift_values
from brace_lightning.objectives import PPOEWMA
from brace_lightning.objectives.aggregation import LossAggregation
from brace_lightning.ranks import Ranks, whiten
from brace_lightning.scorer import Scored, Scorer
from brace_lightning.step_metrics import UpdateStats
from brace_lightning.targets import GRPO
from tests.test_kl_reference import fit_steps, fixed_batch, sgd_module, weights

TINY: dict[str, Any] = {"tiny_hidden_size": 32, "tiny_num_layers": 1, "seed": 0}


def test_the_module_file_and_its_training_step_stay_readable() -> None:
    """The architecture issue's limits: module.py at most 500 lines, training_step at most 40."""
    assert len(inspect.getsource(module_file).splitlines()) <= 500
    assert len(inspect.getsource(BraceModule.training_step).splitlines()) <= 40


def test_scored_rows_selects_every_tensor_and_keeps_the_missing_ones() -> None:
    tensors = [torch.arange(12.0).reshape(4, 3) + i for i in range(4)]
    scored = Scored(tensors[0], None, tensors[1], tensors[2], tensors[3], tensors[0] * 2)
    rows = torch.tensor([2, 0])
    picked = scored.rows(rows)
    assert picked.ewma is None
    assert torch.equal(picked.proximal, tensors[0][rows])
    assert torch.equal(picked.reference, tensors[1][rows])
    assert torch.equal(picked.advantages, tensors[0][rows] * 2)


def test_update_stats_fold_fractions_tokens_means_and_maxima() -> None:
    """Two minibatches of 10 and 5 action tokens; an objective's ``*_count``, ``*_sum``, ``*_max``
    and plain stats, folded as the docstring says (checked against plain arithmetic)."""
    stats = UpdateStats()
    for tokens, count, total, peak, loss in ((10.0, 4.0, 3.0, 1.5, 0.2), (5.0, 1.0, 2.0, 2.5, 0.4)):
        for half in (0.5, 0.5):  # two micro-batches per minibatch
            stats.add_objective(
                "actor",
                {
                    "clip_count": torch.tensor(count * half),
                    "ratio_sum": torch.tensor(total * half),
                    "ratio_max": torch.tensor(peak * half * 2),
                    "entropy": torch.tensor(loss * half),
                },
                torch.tensor(tokens),
            )
        stats.end_minibatch(stats.minibatch)
        stats.append("actor/grad_norm", torch.tensor(tokens))
    folded = {k: float(v) for k, v in stats.fold(ppo_epochs=1).items()}
    assert folded["actor/clip_fraction"] == pytest.approx((4 / 10 + 1 / 5) / 2)
    assert folded["actor/clip_tokens"] == pytest.approx(5.0)  # per pass over the batch
    assert folded["actor/ratio_mean"] == pytest.approx((3 / 10 + 2 / 5) / 2)
    assert folded["actor/ratio_max"] == pytest.approx(2.5)
    assert folded["actor/entropy"] == pytest.approx((0.2 + 0.4) / 2)
    assert folded["actor/grad_norm"] == pytest.approx(7.5)
    assert stats.fold(ppo_epochs=2)["actor/clip_tokens"] == pytest.approx(2.5)


def test_the_scorer_decides_packing_once_and_refuses_to_guess_before() -> None:
    module = BraceModule(**TINY)
    scorer = Scorer(micro_batch_size=None, max_tokens=None, pack_sequences=True)
    batch = fixed_batch()
    with pytest.raises(RuntimeError, match="Scorer.prepare must run before the first forward"):
        scorer.plan(batch.attention_mask)
    scorer.prepare(module.actor, module.critic, [])
    assert scorer.packed is True
    scorer.pack_sequences = False
    scorer.prepare(module.actor, module.critic, [])  # decided already: no change
    assert scorer.packed is True
    padded = Scorer(micro_batch_size=2, max_tokens=None, pack_sequences=False)
    padded.prepare(module.actor, module.critic, [])
    assert padded.packed is False and len(padded.plan(batch.attention_mask)) == 3
    with torch.no_grad():
        packed_lp = scorer.score(module.actor, batch, scorer.plan(batch.attention_mask), 1.0)
        padded_lp = padded.score(module.actor, batch, padded.plan(batch.attention_mask), 1.0)
    torch.testing.assert_close(
        torch.where(batch.mask, packed_lp, 0), torch.where(batch.mask, padded_lp, 0)
    )


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_score_sq_norms_match_a_float64_reference_on_the_padded_batch(packed, mode) -> None:
    """Each row's ‖∇_θ Σ_t f_i log π_θ(y_t)‖² (f_i the aggregation's row factor), computed row by
    row on the row's own columns, equals the gradient of that row's part of one padded float64
    forward of the whole batch; no ``.grad`` is written, and a row without actions gets 0."""
    module = BraceModule(**TINY)
    actor = module.actor.double()
    batch = fixed_batch()
    batch.mask[5] = False  # no actions
    scorer = Scorer(micro_batch_size=None, max_tokens=None, pack_sequences=packed)
    scorer.prepare(actor, None, [])
    with torch.no_grad():
        got = scorer.score_sq_norms(actor, batch, 1.0, LossAggregation(mode).weigh)
    assert got.dtype == torch.float64 and all(p.grad is None for p in actor.parameters())
    params = [p for p in actor.parameters() if p.requires_grad]
    logprobs = token_logprobs(actor, batch.input_ids, batch.attention_mask)[0]
    assert logprobs.dtype == torch.float64
    for i in range(len(batch) - 1):
        total = logprobs[i][batch.mask[i]].sum()
        if mode == "seq_mean_token_mean":
            total = total / batch.mask[i].sum()
        grads = torch.autograd.grad(total, params, retain_graph=True, allow_unused=True)
        want = sum(float(g.square().sum()) for g in grads if g is not None)
        assert float(got[i]) == pytest.approx(want, rel=1e-9), i
    assert float(got[5]) == 0.0 and bool((got[:5] > 0).all())


@pytest.mark.parametrize(("packed", "chunked"), [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_logit_sq_norms_match_a_float64_reference_on_the_padded_batch(
    packed, mode, chunked
) -> None:
    """Each row's Σ_t f_i² ‖e_{y_t} − π_t‖² / τ² (the forward-only proxy) equals the squared norm of
    the gradient of that row's f_i-weighted log-probs with respect to the logits of one padded
    float64 forward of the whole batch, on packed and padded micro-batches (two of them), through
    the chunked LM head and the full logits; a row without actions gets 0."""
    module = BraceModule(**TINY)
    actor = module.actor.double()
    batch = fixed_batch()
    batch.mask[5] = False  # no actions
    temperature = 0.7
    scorer = Scorer(micro_batch_size=3, max_tokens=None, pack_sequences=packed)
    scorer.prepare(actor, None, [])
    plan = scorer.plan(batch.attention_mask)
    assert len(plan) == 2
    if not chunked:  # packed rows always use the chunked head
        actor.get_output_embeddings = lambda: None  # no plain linear head: the full logits
    got = scorer.logit_sq_norms(actor, batch, plan, temperature, LossAggregation(mode).weigh)
    assert got.dtype == torch.float64 and all(p.grad is None for p in actor.parameters())
    ids, attn = batch.input_ids, batch.attention_mask
    with torch.no_grad():
        inputs = {"attention_mask": attn, "position_ids": position_ids_from_attention_mask(attn)}
        logits = type(actor).forward(actor, ids, **inputs).logits
    logits = logits.detach().requires_grad_(True)
    assert logits.dtype == torch.float64
    picked = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, ids[:, 1:, None])
    for i in range(len(batch) - 1):
        total = picked[i, :, 0][batch.mask[i, 1:]].sum()
        if mode == "seq_mean_token_mean":
            total = total / batch.mask[i].sum()
        (grad,) = torch.autograd.grad(total, logits, retain_graph=True)
        assert float(got[i]) == pytest.approx(float(grad.square().sum()), rel=1e-9), i
    assert float(got[5]) == 0.0 and bool((got[:5] > 0).all())


def test_the_scorer_refuses_exact_score_norms_for_an_fsdp2_actor_in_one_sentence() -> None:
    class Sharded(FSDPModule, torch.nn.Linear):
        pass

    sharded = torch.nn.Linear(2, 2)
    sharded.__class__ = Sharded  # as fully_shard swaps a module's class
    scorer = Scorer(micro_batch_size=None, max_tokens=None, pack_sequences=False)
    exact, proxy = GRPO(optimal_baseline=True), GRPO(optimal_baseline=True, score_norm="logits")
    with pytest.raises(ValueError, match="optimal_baseline=True needs each row's gradient norm"):
        scorer.prepare(sharded, None, [], exact)
    scorer.prepare(torch.nn.Linear(2, 2), None, [], exact)  # unsharded: fine
    assert scorer.packed is False
    for target in (proxy, GRPO(), None):  # forward-only norms, or none: fine sharded
        Scorer(micro_batch_size=None, max_tokens=None, pack_sequences=False).prepare(
            sharded, None, [], target
        )


def test_a_batch_without_actions_is_refused_with_the_producers_counts() -> None:
    batch = fixed_batch()
    batch.require_actions(rollout_step=3)  # has actions: nothing happens
    batch.mask[:] = False
    batch.info["count/dropped_stale"] = 6
    with pytest.raises(RuntimeError, match=r"rollout step 3: .*no action tokens .*dropped_stale"):
        batch.require_actions(rollout_step=3)


def test_the_ewma_policy_is_the_bias_corrected_average_of_the_actor_weights() -> None:
    actor = torch.nn.Linear(3, 2)
    ewma = EwmaPolicy(actor, decay=0.7)
    assert not ewma.ready
    history = []
    for step in range(3):
        with torch.no_grad():
            actor.weight.add_(step + 1.0)
        history.append(actor.weight.detach().double().clone())
        ewma.update(actor)
    n = len(history)
    want = sum(0.3 * 0.7 ** (n - 1 - i) * w for i, w in enumerate(history)) / (1 - 0.7**n)
    assert ewma.ready and int(ewma.steps) == 3
    torch.testing.assert_close(ewma.policy.weight.double(), want, rtol=1e-6, atol=1e-6)


def test_the_reference_stays_in_eval_mode_and_captures_the_actor() -> None:
    module = BraceModule(**TINY, kl_coef=0.1)
    assert isinstance(module.reference, ReferencePolicy)
    module.train()
    assert not module.reference_actor.training and module.actor.training
    with torch.no_grad():
        next(module.actor.parameters()).add_(1.0)
    assert not module.reference.captured
    module.reference.capture(module.actor)
    assert module.reference.captured
    for key, value in module.actor.state_dict().items():
        assert torch.equal(module.reference_actor.state_dict()[key], value), key


def test_ranks_with_one_process_change_nothing() -> None:
    trainer = SimpleNamespace(world_size=1, strategy=None)
    ranks = Ranks(trainer)  # type: ignore[arg-type]
    mask = torch.tensor([[True, False, True]])
    assert float(ranks.global_count(mask)) == 2.0
    assert float(ranks.global_count(torch.zeros_like(mask))) == 1.0  # never divides by 0
    assert ranks.reduce_max is None
    sums = {"actor/loss": torch.tensor(1.0)}
    assert ranks.reduce_stats(sums) is sums
    assert ranks.combine_metrics({"a": 1.0}) == {"a": 1.0}


def test_whiten_and_shift_values_follow_the_token_conventions() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0, 3.0]])
    mask = torch.tensor([[True, True, False, True]])
    out = whiten(x, mask)
    assert float(out[0, 2]) == 0.0
    acted = out[mask].double()
    assert float(acted.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(acted.pow(2).mean()) == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(shift_values(torch.tensor([[1.0, 2.0, 3.0]])), torch.tensor([[0.0, 1, 2]]))


def test_one_step_in_critic_warm_up_trains_only_the_critic() -> None:
    module = sgd_module()
    module.critic_warmup_steps = 1
    actor, critic = weights(module.actor), weights(module.critic)
    metrics = fit_steps(module, fixed_batch(), steps=1)
    assert all(torch.equal(v, weights(module.actor)[k]) for k, v in actor.items())
    assert any(not torch.equal(v, weights(module.critic)[k]) for k, v in critic.items())
    assert module.policy_version == 0 and module.rollout_step == 1
    assert "actor/loss" not in metrics and metrics["critic/loss"] > 0


def test_one_step_after_warm_up_trains_both_and_publishes_a_version() -> None:
    module = sgd_module(actor_objective=PPOEWMA(ewma_decay=0.5))
    actor = weights(module.actor)
    metrics = fit_steps(module, fixed_batch(), steps=2)
    assert any(not torch.equal(v, weights(module.actor)[k]) for k, v in actor.items())
    assert module.policy_version == 2 and int(module.ewma.steps) == 2
    assert {"actor/loss", "actor/grad_norm", "critic/grad_norm", "time/ewma_forward_ms"} <= set(
        metrics
    )


def test_a_checkpoint_with_the_old_copy_names_loads_after_the_upgrade() -> None:
    """Checkpoints written before the copies became modules (``reference_actor.*``,
    ``ewma_actor.*``, ``_ewma_sums.*``, ``ewma_steps``) still load, strictly, with equal values."""
    source = BraceModule(**TINY, kl_coef=0.1, actor_objective=PPOEWMA(ewma_decay=0.5))
    source.ewma.update(source.actor)
    new_names = source.state_dict()
    old = {}
    for key, value in new_names.items():
        for legacy, current in LEGACY_PREFIXES.items():
            if key.startswith(current):
                key = legacy + key.removeprefix(current)
                break
        old[key] = value
    assert "ewma_steps" in old and any(k.startswith("reference_actor.") for k in old)
    checkpoint = {"state_dict": old}
    upgrade_checkpoint_keys(checkpoint)
    target = BraceModule(**TINY, kl_coef=0.1, actor_objective=PPOEWMA(ewma_decay=0.5))
    target.load_state_dict(checkpoint["state_dict"], strict=True)
    assert int(target.ewma.steps) == 1
    for key, value in new_names.items():
        assert torch.equal(target.state_dict()[key], value), key
