"""benchmarks/score_norms.py: its statistics on made-up records (README's command runs the script
itself, briefly, in tests/test_readme_commands.py)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.score_norms import baselines, spearman, summarise


def record(exact: list[float], logits: list[float]) -> dict[str, torch.Tensor]:
    """Two groups of two responses: rewards (0, 1) and (1, 1), every sequence ratio 1."""
    return {
        "exact": torch.tensor(exact, dtype=torch.float64),
        "logits": torch.tensor(logits, dtype=torch.float64),
        "ratios": torch.ones(4, dtype=torch.float64),
        "rewards": torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64),
        "groups": torch.tensor([0, 0, 1, 1]),
    }


def test_spearman_is_the_rank_correlation() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    assert spearman(a, torch.tensor([10.0, 30.0, 20.0])) == pytest.approx(0.5)
    assert spearman(a, -a) == pytest.approx(-1.0)
    assert spearman(a, a.exp()) == pytest.approx(1.0)


def test_baselines_weigh_the_rewards_of_groups_whose_rewards_differ() -> None:
    rec = record([1.0, 3.0, 5.0, 7.0], [2.0, 2.0, 1.0, 9.0])
    assert baselines(rec, "exact") == {0: pytest.approx(0.75)}  # (0 · 1 + 1 · 3) / 4
    assert baselines(rec, "logits") == {0: pytest.approx(0.5)}  # equal weights
    assert baselines(rec, None) == {0: pytest.approx(0.5)}  # GRPO's plain mean


def test_summarise_counts_pairs_ordered_alike_and_the_baseline_gaps() -> None:
    # group 0: exact 1 < 3 and logits 2 > 1 disagree; group 1: 5 < 7 and 1 < 9 agree
    stats = summarise([record([1.0, 3.0, 5.0, 7.0], [2.0, 1.0, 1.0, 9.0])])
    assert stats["steps"] == 1 and stats["responses"] == 4 and stats["groups"] == 1
    assert stats["order"] == pytest.approx(0.5)
    assert stats["proxy_gap"] == pytest.approx(0.75 - 1 / 3)  # b_logits = (0 · 2 + 1 · 1) / 3
    assert stats["exact_shift"] == pytest.approx(0.25)
