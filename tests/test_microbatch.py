"""Token-budget micro-batches (``models/microbatch.py``): the plan, and a trainer step whose losses
and gradients do not depend on the budget."""

from __future__ import annotations

import pytest
import torch

from brace_lightning.cli import run
from brace_lightning.models.microbatch import (
    equalize,
    plan_micro_batches,
    score_rows,
    widen,
)
from brace_lightning.models.sources import TINY, load_actor, load_tokenizer
from tests.test_trainer import actor_weights, small_run


def _mask(spans: list[tuple[int, int]], width: int) -> torch.Tensor:
    mask = torch.zeros(len(spans), width, dtype=torch.bool)
    for row, (start, stop) in enumerate(spans):
        mask[row, start:stop] = True
    return mask


def test_plan_sorts_by_length_and_respects_both_limits():
    # Left-padded prompts start at different columns; responses end at different columns.
    mask = _mask([(6, 9), (0, 16), (4, 12), (5, 7), (2, 14), (7, 8)], 16)
    plan = plan_micro_batches(mask, max_tokens=24)
    covered = torch.cat([m.rows for m in plan]).sort().values
    assert torch.equal(covered, torch.arange(6))
    assert plan[0].rows.tolist() == [1] and plan[0].columns == slice(0, 16)  # wider than budget
    for micro in plan[1:]:
        assert micro.tokens <= 24
        window = mask[micro.rows].any(0).nonzero().flatten()
        assert micro.columns == slice(int(window[0]), int(window[-1]) + 1)
    lengths = [int(mask[m.rows].sum(1).max()) for m in plan]
    assert lengths == sorted(lengths, reverse=True)
    by_rows = plan_micro_batches(mask, max_rows=2)
    assert [len(m.rows) for m in by_rows] == [2, 2, 2]
    assert len(plan_micro_batches(mask)) == 1
    with pytest.raises(ValueError, match="max_tokens=0"):
        plan_micro_batches(mask, max_tokens=0)


def test_packed_plan_counts_real_tokens_only():
    # Rows of 3, 16, 8, 2, 12 and 1 real tokens at scattered columns: padded, the window of any
    # two rows is wide; packed, only their lengths add up.
    mask = _mask([(6, 9), (0, 16), (4, 12), (5, 7), (2, 14), (7, 8)], 16)
    plan = plan_micro_batches(mask, max_tokens=14, packed=True)
    assert [m.rows.tolist() for m in plan] == [[1], [4], [2, 0, 3, 5]]
    for micro in plan[1:]:
        assert int(mask[micro.rows].sum()) <= 14
    padded = plan_micro_batches(mask, max_tokens=14)  # rows × width <= 14
    assert [m.rows.tolist() for m in padded] == [[1], [4], [2], [0, 3, 5]]
    assert len(plan_micro_batches(mask, max_tokens=42, packed=True)) == 1


def test_equalize_splits_then_adds_zero_weight_fillers():
    mask = _mask([(0, 4), (1, 4), (2, 4)], 4)
    plan = plan_micro_batches(mask)
    grown = equalize(plan, 5, mask)
    assert len(grown) == 5
    assert sorted(torch.cat([m.rows for m in grown if m.weight]).tolist()) == [0, 1, 2]
    assert [m.weight for m in grown] == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_score_rows_equals_one_call_and_widen_pads():
    mask = _mask([(3, 8), (0, 5), (1, 2)], 8)
    ids = torch.arange(24).reshape(3, 8)

    def score(i: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return torch.where(a, i.float() * 2, 0.0)

    whole = score(ids, mask)
    for budget in (1, 6, 100):
        plan = plan_micro_batches(mask, max_tokens=budget)
        assert torch.equal(score_rows(score, ids, mask, plan), whole)
    part = torch.ones(2, 3)
    assert torch.equal(widen(part, slice(2, 5), 7)[0], torch.tensor([0, 0, 1, 1, 1, 0, 0.0]))


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_token_budget_step_equals_one_big_batch(tmp_path, packed):
    """One rollout step with a 40-token budget ends at the same actor and critic weights as one
    big batch. Rows are prompt + up to 12 response tokens (20-30 columns), so the budget cuts the
    8 rows into micro-batches of one or two, the scoring forwards included; with
    ``--model.pack_sequences=true`` the budget counts real tokens and the rows run packed."""
    whole = run(small_run(tmp_path / "a", "--data.lag=0", steps=1))
    budget = run(
        small_run(
            tmp_path / "b",
            "--data.lag=0",
            "--model.max_tokens_per_micro_batch=40",
            f"--model.pack_sequences={str(packed).lower()}",
            steps=1,
        )
    )
    assert budget.model.scorer.packed is packed
    a, b = actor_weights(whole), actor_weights(budget)
    initial = load_actor(
        TINY, tokenizer=load_tokenizer(TINY), hidden_size=64, num_layers=1, seed=0
    ).state_dict()
    assert any(not torch.equal(a[name], initial[name]) for name in a), "the step changed nothing"
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    ca, cb = whole.model.critic.state_dict(), budget.model.critic.state_dict()
    for name in ca:
        torch.testing.assert_close(ca[name], cb[name], rtol=1e-5, atol=1e-6, msg=name)
