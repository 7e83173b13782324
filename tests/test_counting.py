"""The counting task: prompts, reference lists, the exact-match reward and its partial credit."""

from __future__ import annotations

import itertools

import pytest
import torch

from brace_lightning.models.sources import load_tokenizer
from brace_lightning.tasks import CountingReward, CountingTask
from brace_lightning.tasks.counting import correct_prefix, count_solution


def test_count_solution_lists_every_integer_with_carries():
    assert count_solution(98, 101) == "98;99;100;101"
    assert count_solution(7, 7) == "7"
    with pytest.raises(ValueError, match="start=5 > stop=4"):
        count_solution(5, 4)


def test_prompts_are_exact_in_range_and_long():
    task = CountingTask(span=(38, 48), low=100, high=999, seed=3)
    prompts = task.sample(200, torch.Generator().manual_seed(0))
    tokenizer = load_tokenizer("tiny-char")
    lengths = []
    for prompt in prompts:
        start, stop = prompt.metadata["start"], prompt.metadata["stop"]
        assert prompt.text == f"{start}:{stop}="
        assert 100 <= start and stop <= 999 and 38 <= stop - start + 1 <= 48
        assert [int(n) for n in prompt.answer.split(";")] == list(range(start, stop + 1))
        lengths.append(len(tokenizer(prompt.answer)["input_ids"]))
    # Three-digit numbers: 4 tokens per integer less the last separator.
    assert min(lengths) >= 151 and max(lengths) <= 191
    assert {len(p.answer.split(";")) for p in prompts} == set(range(38, 49))


def test_stream_is_deterministic_and_pairs_differ_from_it():
    task = CountingTask(seed=1)
    first = [p.text for p in itertools.islice(task, 20)]
    assert first == [p.text for p in itertools.islice(task, 20)]
    assert first != [p.text for p in itertools.islice(CountingTask(seed=2), 20)]
    pairs = task.supervised_pairs(20)
    assert [text for text, _ in pairs] != first
    assert all(
        solution == count_solution(*map(int, text[:-1].split(":"))) for text, solution in pairs
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"span": 1}, "span=1; expected an integer >= 2"),
        ({"span": (10, 5)}, r"span=\(10, 5\)"),
        ({"low": -1}, "low=-1, high=999"),
        ({"span": 50, "low": 0, "high": 10}, "room for the longest span"),
        # Wrong types get the same one sentence, not a TypeError from a comparison.
        ({"end_multiple": "x"}, "end_multiple='x'; expected None or an integer >= 1"),
        ({"end_multiple": 2.5}, "end_multiple=2.5; expected None or an integer >= 1"),
        ({"span": "ab"}, "span='ab'; expected an integer >= 2 or a range"),
        ({"span": (3, "x")}, r"span=\(3, 'x'\); expected an integer >= 2 or a range"),
        ({"low": "1"}, "low='1', high=999; expected 0 <= low"),
        ({"high": 5.0}, "low=100, high=5.0; expected 0 <= low"),
    ],
)
def test_task_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CountingTask(**kwargs)


def test_reward_exact_match_and_partial_credit():
    prompt = CountingTask(span=4, low=10, high=13).sample(1, torch.Generator())[0]
    assert prompt.answer == "10;11;12;13"
    exact = CountingReward()
    assert exact(prompt, " 10;11;12;13\n") == 1.0 and exact.is_correct(prompt, "10;11;12;13")
    for wrong in ("10;11;12", "10;11;12;13;14", "10;11;21;13", "", "#13"):
        assert exact(prompt, wrong) == 0.0 and not exact.is_correct(prompt, wrong)
    partial = CountingReward(partial=0.5)
    assert partial(prompt, "10;11;12;13") == 1.0
    assert partial(prompt, "10;11;21;13") == pytest.approx(0.5 * 2 / 4)
    assert partial(prompt, "10;11;12;13;14") == pytest.approx(0.5)
    assert partial(prompt, "9;10") == 0.0
    assert correct_prefix("10; 11 ;12", "10;11;12;13") == 3
    with pytest.raises(ValueError, match="partial=1.0; expected a value in"):
        CountingReward(partial=1.0)


def test_end_multiple_puts_every_stop_on_a_multiple():
    task = CountingTask(span=(38, 48), low=100, high=999, end_multiple=100)
    prompts = task.sample(300, torch.Generator().manual_seed(1))
    stops = {p.metadata["stop"] for p in prompts}
    assert stops == {200, 300, 400, 500, 600, 700, 800, 900}
    assert all(p.metadata["start"] >= 100 and 38 <= len(p.answer.split(";")) <= 48 for p in prompts)
    with pytest.raises(ValueError, match="end_multiple=1000; expected None or an integer >= 1"):
        CountingTask(end_multiple=1000)
