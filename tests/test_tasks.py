"""Arithmetic and GSM8K tasks: prompt generation, loading, answer extraction and verifiers."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch

from brace_lightning.tasks.arithmetic import (
    ArithmeticReward,
    ArithmeticTask,
    parse_final_answer,
    solve,
)
from brace_lightning.tasks.base import Prompt, RewardFunction
from brace_lightning.tasks.gsm8k import (
    GSM8K,
    GSM8KReward,
    answers_match,
    extract_final_answer,
    load_gsm8k_hub,
    load_gsm8k_jsonl,
)

FIXTURE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"


# ---------------------------------------------------------------- arithmetic


def test_solve_formats_steps_and_parenthesises():
    assert solve([12, 7, 5], ["+", "+"]) == ("12+7+5", "12+7=19;19+5=24#24", 24)
    assert solve([3, 7, 5], ["-", "+"]) == ("3-7+5", "3-7=-4;-4+5=1#1", 1)
    assert solve([2, 3, 4], ["+", "*"]) == ("(2+3)*4", "2+3=5;5*4=20#20", 20)
    assert solve([2, 3, 4], ["*", "+"])[0] == "2*3+4"
    with pytest.raises(ValueError, match="operator '/'"):
        solve([1, 2], ["/"])
    with pytest.raises(ValueError, match="1 operands"):
        solve([1], [])


def test_arithmetic_prompts_are_exact_and_in_range():
    task = ArithmeticTask(num_operands=(2, 4), max_value=9, ops="+-*", seed=1)
    prompts = list(itertools.islice(iter(task), 200))
    for prompt in prompts:
        assert prompt.text.endswith("=")
        assert eval(prompt.text[:-1]) == int(prompt.answer)  # usual precedence, same value
        assert 2 <= len(prompt.metadata["operands"]) <= 4
        assert all(0 <= x <= 9 for x in prompt.metadata["operands"])
        assert ArithmeticReward()(prompt, ArithmeticTask.solution(prompt)) == 1.0
    assert {len(p.metadata["operands"]) for p in prompts} == {2, 3, 4}
    assert {op for p in prompts for op in p.metadata["ops"]} == {"+", "-", "*"}


def test_arithmetic_is_deterministic():
    task = ArithmeticTask(seed=3)
    assert list(itertools.islice(task, 20)) == list(itertools.islice(task, 20))
    a = task.sample(10, torch.Generator().manual_seed(0))
    b = task.sample(10, torch.Generator().manual_seed(0))
    c = task.sample(10, torch.Generator().manual_seed(1))
    assert a == b and a != c
    pairs = task.supervised_pairs(5)
    assert pairs == task.supervised_pairs(5) and pairs != task.supervised_pairs(5, seed=9)
    assert all(text.endswith("=") and "#" in solution for text, solution in pairs)


def test_arithmetic_difficulty_dials():
    long = ArithmeticTask(num_operands=5, max_value=999, seed=0)
    short = ArithmeticTask(num_operands=2, max_value=9, seed=0)
    long_len = sum(len(long.solution(p)) for p in itertools.islice(long, 20))
    short_len = sum(len(short.solution(p)) for p in itertools.islice(short, 20))
    assert long_len > 3 * short_len


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_operands": 1}, "num_operands=1"),
        ({"num_operands": (3, 2)}, r"num_operands=\(3, 2\)"),
        ({"max_value": 0}, "max_value=0"),
        ({"ops": "+/"}, "ops='\\+/'"),
    ],
)
def test_arithmetic_task_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)


def test_arithmetic_reward():
    prompt = Prompt("12+7+5=", "24")
    reward = ArithmeticReward()
    assert reward(prompt, "12+7=19;19+5=24#24") == 1.0
    assert reward(prompt, "#24") == 1.0 and reward(prompt, "# 24 ") == 1.0
    assert reward(prompt, "12+7=19;19+5=25#25") == 0.0
    for malformed in ["", "24", "#", "#24a", "#2 4", "#twenty", "12+7=19;19+5=24#24;"]:
        assert parse_final_answer(malformed) is None, malformed
        assert reward(prompt, malformed) == 0.0, malformed
    assert parse_final_answer("3-7=-4#-4") == -4
    shaped = ArithmeticReward(format_reward=0.1)
    assert (
        shaped(prompt, "#25") == 0.1 and shaped(prompt, "#x") == 0.0 and shaped(prompt, "#24") == 1
    )
    assert not shaped.is_correct(prompt, "#25") and shaped.is_correct(prompt, "#24")
    with pytest.raises(ValueError, match="format_reward=1.0"):
        ArithmeticReward(format_reward=1.0)


def test_custom_reward_function_default_is_correct():
    class Contains(RewardFunction):
        def __call__(self, prompt: Prompt, completion: str) -> float:
            return float(prompt.answer in completion)

    assert Contains().is_correct(Prompt("q", "42"), "it is 42")
    assert not Contains().is_correct(Prompt("q", "42"), "it is 41")


# ---------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "7"),
        ("#### 1,525", "1525"),
        ("so the answer is #### $18.50.", "18.50"),
        ("#### -5", "-5"),
        ("First 12, then 30. The answer is 42.", "42"),
        ("The total is $1,234.", "1234"),
        ("no numbers here", None),
        ("12 apples #### none", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_answers_match_numerically():
    assert answers_match("18", "18.00") and answers_match("-5", "-5.0")
    assert not answers_match("18", "19") and not answers_match(None, "18")
    assert not answers_match("1.2.3", "1")


def test_fixture_loads():
    prompts = load_gsm8k_jsonl(FIXTURE)
    assert len(prompts) == 11
    assert prompts[0].text.startswith("Question: Mara has 14 marbles.")
    assert prompts[0].text.endswith("\nAnswer:")
    assert [p.answer for p in prompts] == [
        "18",
        "231",
        "252",
        "192",
        "1525",
        "150",
        "4",
        "21",
        "1.25",
        "-5",
        "21",
    ]
    assert prompts[4].metadata["source"].endswith("gsm8k_sample.jsonl:5")
    reward = GSM8KReward()
    for prompt in prompts:
        assert reward(prompt, prompt.metadata["solution"]) == 1.0


def test_gsm8k_reward_and_strict_flag():
    prompt = Prompt("q", "1525")
    assert GSM8KReward()(prompt, "She has 1,525 dollars.") == 1.0
    assert GSM8KReward()(prompt, "She has 1,524 dollars.") == 0.0
    assert GSM8KReward()(prompt, "") == 0.0
    assert GSM8KReward(strict=True)(prompt, "She has 1,525 dollars.") == 0.0
    assert GSM8KReward(strict=True)(prompt, "... #### 1525") == 1.0
    assert GSM8KReward()(prompt, "#### 1524 and later 1525") == 0.0


def test_gsm8k_source_from_file_and_sampling():
    source = GSM8K(str(FIXTURE), prompt_template="{question}\n")
    assert len(source) == 11 and list(source) == list(source)
    assert source[0].text.endswith("now?\n")
    a = source.sample(5, torch.Generator().manual_seed(0))
    assert a == source.sample(5, torch.Generator().manual_seed(0))
    assert len({p.text for p in a}) == 5  # without replacement
    assert len(source.sample(30, torch.Generator().manual_seed(0))) == 30
    pairs = source.supervised_pairs()
    assert len(pairs) == 11 and pairs[0][0] == source[0].text
    assert pairs[0][1].startswith(" After buying") and pairs[0][1].endswith("#### 18")
    drawn = source.supervised_pairs(4, seed=1)
    assert len(drawn) == 4 and drawn == source.supervised_pairs(4, seed=1)
    assert set(drawn) <= set(pairs)
    with pytest.raises(ValueError, match="prompt_template='Q'"):
        GSM8K(str(FIXTURE), prompt_template="Q")


def test_gsm8k_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_gsm8k_jsonl(missing)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        GSM8K(str(missing))


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", "invalid JSON"),
        ('{"question": "q"}', "string fields 'question' and 'answer'"),
        ('["q", "a"]', "string fields"),
        ('{"question": "q", "answer": "it is 4"}', "no '#### <number>'"),
    ],
)
def test_gsm8k_malformed_line_names_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "q", "answer": "#### 1"})
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(ValueError, match=match) as info:
        load_gsm8k_jsonl(path)
    assert f"{path}:3" in str(info.value)


def test_gsm8k_hub_without_datasets_says_what_to_install(monkeypatch: pytest.MonkeyPatch):
    # The peers extra installs datasets; None in sys.modules makes its import fail as if absent.
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        load_gsm8k_hub()
    with pytest.raises(ImportError, match="pip install datasets"):
        GSM8K("openai/gsm8k")
