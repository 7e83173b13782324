"""Held-out evaluation: disjoint task splits, the validation prompt source, mean@n and pass@k
(against a float64 reference of Chen et al.'s estimator) and what validate / test log."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction
from functools import partial
from pathlib import Path

import pytest
import torch

from brace_lightning.cli import run
from brace_lightning.data import RolloutDataModule
from brace_lightning.data.eval_plan import EvaluationPlan
from brace_lightning.logs import read_scalars
from brace_lightning.metrics.pass_at_k import correct_per_prompt, pass_at_k, sampling_metrics
from brace_lightning.models.handoff import ActorHandoff
from brace_lightning.tasks import (
    ArithmeticReward,
    ArithmeticTask,
    CountingTask,
    HFPrompts,
    JSONLPrompts,
)
from brace_lightning.tasks.split import held_out_score, in_split
from tests.test_async import FAKE_ACTOR, ConstantReward, FakeEngine
from tests.test_trainer import small_run

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# ---------------------------------------------------------------- pass@k


def reference_pass_at_k(n: int, c: int, k: int) -> float:
    """1 − C(n − c, k) / C(n, k), exactly (math.comb is 0 when n − c < k)."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.mark.slow
def test_pass_at_k_matches_the_exact_binomial_ratio_in_float64() -> None:
    for n in (1, 2, 5, 16, 32, 100):
        for k in sorted({1, min(2, n), n // 2 or 1, n}):
            counts = torch.arange(n + 1)
            got = pass_at_k(n, counts, k)
            assert got.dtype == torch.float64
            want = torch.tensor(
                [reference_pass_at_k(n, c, k) for c in range(n + 1)], dtype=torch.float64
            )
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_pass_at_k_identities() -> None:
    counts = torch.tensor([0, 3, 7, 8])
    # pass@1 is the fraction correct, pass@n is "any correct", and pass@k grows with k
    torch.testing.assert_close(pass_at_k(8, counts, 1), counts.double() / 8)
    assert pass_at_k(8, counts, 8).tolist() == [0.0, 1.0, 1.0, 1.0]
    by_k = torch.stack([pass_at_k(8, counts, k) for k in range(1, 9)])
    assert bool((by_k.diff(dim=0) >= -1e-15).all())
    # rows are independent: one prompt's count does not move another's estimate
    assert pass_at_k(8, counts[1:2], 3).item() == pass_at_k(8, counts, 3)[1].item()


def test_pass_at_k_refuses_k_above_n_and_impossible_counts() -> None:
    with pytest.raises(ValueError, match="k=5 with 4 samples per prompt"):
        pass_at_k(4, torch.tensor([1]), 5)
    with pytest.raises(ValueError, match=r"expected integers in \[0, 4\]"):
        pass_at_k(4, torch.tensor([5]), 1)


def test_a_dropped_response_counts_as_not_correct() -> None:
    # prompts 0..2, two responses each were requested; prompt 2 lost both (reward errors)
    index = torch.tensor([0, 0, 1])
    correct = torch.tensor([True, False, True])
    counts = correct_per_prompt(index, correct, 3)
    assert counts.tolist() == [1, 1, 0]
    metrics = sampling_metrics(counts, 2, [1, 2])
    assert metrics == {
        "mean@2": pytest.approx(1 / 3),
        "pass@1": pytest.approx(1 / 3),
        "pass@2": 2 / 3,
    }


# ---------------------------------------------------------------- held-out task splits


@pytest.mark.parametrize(
    "task",
    [
        lambda **kw: ArithmeticTask(seed=0, **kw),
        lambda **kw: CountingTask(span=3, high=150, seed=0, **kw),
    ],
    ids=["arithmetic", "counting"],
)
def test_train_and_held_out_parts_share_no_prompt(task) -> None:
    train = task(split="train", held_out_fraction=0.2)
    held_out = train.held_out()
    assert held_out is not None and held_out.split == "held_out" and train.split == "train"
    generator = torch.Generator().manual_seed(1)
    seen = {p.text for p in train.sample(2000, generator)}
    seen |= {text for text, _ in train.supervised_pairs(500)}  # the warm start's pairs too
    evaluated = {p.text for p in itertools.islice(iter(held_out), 500)}
    assert evaluated and seen and not seen & evaluated
    assert all(held_out_score(text) < 0.2 for text in evaluated)
    # the whole task ("all") draws from both parts
    everything = {p.text for p in task().sample(2000, torch.Generator().manual_seed(1))}
    assert everything & evaluated and everything - evaluated


def test_split_all_draws_exactly_as_before() -> None:
    task = ArithmeticTask(seed=3)
    generator = torch.Generator().manual_seed(5)
    drawn = task.sample(50, generator)
    plain = torch.Generator().manual_seed(5)
    assert drawn == [task.draw(plain) for _ in range(50)]
    assert generator.get_state().equal(plain.get_state())  # the same random numbers consumed
    assert task.held_out() is None


def test_split_rule_and_its_arguments() -> None:
    assert in_split("1+2=", "all", 0.5)
    assert in_split("1+2=", "train", 0.5) != in_split("1+2=", "held_out", 0.5)
    with pytest.raises(ValueError, match="split must be one of all, train, held_out; got 'test'"):
        ArithmeticTask(split="test")
    with pytest.raises(ValueError, match=r"held_out_fraction must be a number in \(0, 1\); got 1"):
        ArithmeticTask(split="train", held_out_fraction=1)
    # a part with no prompt in it says so instead of drawing forever
    tiny = ArithmeticTask(
        num_operands=2, max_value=1, ops="+", split="held_out", held_out_fraction=1e-9
    )
    with pytest.raises(ValueError, match="outside split='held_out'"):
        tiny.sample(1, torch.Generator().manual_seed(0))


# ---------------------------------------------------------------- the validation prompts


def test_validation_prompts_val_task_then_held_out_part_then_the_task() -> None:
    task = ArithmeticTask(seed=0)
    held = JSONLPrompts(
        str(EXAMPLES / "my_prompts.jsonl"), prompt_field="question", answer_field="label"
    )
    assert EvaluationPlan.of(task, held, 4, None).prompts is held
    assert EvaluationPlan.of(task, None, 4, None).prompts is task
    split = ArithmeticTask(seed=0, split="train")
    assert EvaluationPlan.of(split, None, 4, None).prompts.split == "held_out"
    assert EvaluationPlan.of(split, None, 4, None).pass_k == (4,)
    dm = RolloutDataModule(
        task=split, reward=ArithmeticReward(), val_samples_per_prompt=8, pass_k=[1, 8]
    )
    assert (dm.evaluation.samples_per_prompt, dm.evaluation.pass_k) == (8, (1, 8))
    assert dm.samples_per_prompt == 4  # training keeps its own


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pass_k": [1, 8]}, r"pass_k must hold integers in \[1, 4\] .*got \[1, 8\]"),
        ({"pass_k": [0]}, r"pass_k must hold integers in \[1, 4\]"),
        ({"val_samples_per_prompt": 0}, "val_samples_per_prompt must be an integer >= 1"),
    ],
)
def test_evaluation_arguments_are_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RolloutDataModule(task=ArithmeticTask(), reward=ArithmeticReward(), **kwargs)


def test_validation_batches_sample_a_hub_test_split_with_n_responses_and_report_pass_at_k(
    tmp_path: Path,
) -> None:
    pytest.importorskip("datasets")
    folder = tmp_path / "held_out"
    folder.mkdir()
    rows = [{"question": f"{a}+{a}=", "label": str(2 * a)} for a in range(5)]
    (folder / "test.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    (folder / "train.jsonl").write_text(json.dumps({"question": "9+9=", "label": "18"}))
    held_out = HFPrompts(str(folder), split="test", prompt_field="question", answer_field="label")
    calls: list = []
    dm = RolloutDataModule(
        task=ArithmeticTask(seed=0),
        reward=ConstantReward(),
        engine=partial(FakeEngine, calls=calls),
        prompts_per_step=2,
        samples_per_prompt=2,
        val_batches=2,
        val_task=held_out,
        val_samples_per_prompt=3,
        pass_k=[1, 3],
    )
    dm.connect(ActorHandoff(FAKE_ACTOR, bucket_bytes=None))
    batches = list(dm.val_dataloader())
    asked = {dm.tokenizer.decode(ids) for call in calls for ids in call}
    assert len(batches) == 2 and asked <= {row["question"] for row in rows}
    for index, batch in enumerate(batches):
        assert len(batch) == 2 * 3  # val_samples_per_prompt, not samples_per_prompt
        assert batch.group_ids.tolist() == [2 * index] * 3 + [2 * index + 1] * 3
        assert batch.info["mean@3"] == batch.info["pass@1"] == batch.info["pass@3"] == 1.0
        assert batch.info["prompts"] == 2.0
    assert len(list(dm.test_dataloader())) == 2 and len(calls) == 4  # test: the same batches


# ---------------------------------------------------------------- validate and test


@pytest.mark.slow
def test_validate_and_test_log_mean_and_pass_at_k_of_the_held_out_prompts(tmp_path: Path) -> None:
    options = [
        "--data.reward=tests.test_trainer.ParityReward",
        "--data.val_batches=2",
        "--data.task.split=train",
        "--data.val_samples_per_prompt=4",
        "--data.pass_k=[1,2,4]",
    ]
    cli = run(["validate", *small_run(tmp_path / "validate", *options)[1:]])
    results = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert cli.datamodule.evaluation.prompts.split == "held_out"
    for name in ("val/mean@4", "val/pass@1", "val/pass@2", "val/pass@4", "val/value_mse_mc"):
        assert name in results, results
    # pass@1 is mean@n; random lengths' parity: some but not all responses are right
    assert results["val/pass@1"] == pytest.approx(results["val/mean@4"])
    assert 0 < results["val/pass@1"] <= results["val/pass@2"] <= results["val/pass@4"] <= 1
    assert results["val/mean@4"] == pytest.approx(results["val/accuracy"])  # nothing dropped

    fitted = run(small_run(tmp_path / "fit", *options))
    scalars = read_scalars(fitted.trainer.logger.log_dir)
    assert [step for step, _ in scalars["val/pass@4"]] == [2]  # fit validates at the epoch end

    tested = run(["test", *small_run(tmp_path / "test", *options)[1:]])
    scores = {k: float(v) for k, v in tested.trainer.callback_metrics.items()}
    assert {"test/reward", "test/mean@4", "test/pass@4", "test/value_mse_mc"} <= set(scores)
    assert scores["test/pass@4"] == pytest.approx(results["val/pass@4"])  # the same draws
