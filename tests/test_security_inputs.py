"""Well-formed but unusual input is handled the same way every time (issue 34, item 7).

A prompt file that is not UTF-8, or a record whose prompt is null or not a string, is refused
naming the file and the line; a reward is read the same way whatever real-number type the verifier
returns, and one beyond float32's range drops its sample (counted, named in the log) instead of
ending the run; the calculator reads decimal literals exactly.
"""

from __future__ import annotations

import json
import logging
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from brace_lightning.models import load_tokenizer
from brace_lightning.rollout.collect import MAX_REWARD, reward_value, score_and_pad
from brace_lightning.rollout.engine import GenerationOutput
from brace_lightning.tasks import JSONLPrompts
from brace_lightning.tasks.base import Prompt, RewardFunction
from brace_lightning.tasks.calculator import CalculatorEnv, CalculatorError, safe_eval

TOKENIZER = load_tokenizer("tiny-char")

# ---------------------------------------------------------------- prompt files


def test_a_prompt_file_that_is_not_utf8_is_named_by_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"prompt": "a", "answer": "1"}).encode()
    path.write_bytes(
        good + b"\n" + good + b"\n" + '{"prompt": "café", "answer": "2"}\n'.encode("latin-1")
    )
    with pytest.raises(
        ValueError, match=r"latin1.jsonl:3: byte 16 of the line is not UTF-8 \(b'\\xe9'\)"
    ):
        JSONLPrompts(str(path))


@pytest.mark.parametrize(
    ("record", "field", "shown"),
    [
        ({"prompt": None, "answer": "1"}, "prompt_field='prompt'", "'null'"),
        ({"prompt": 12, "answer": "1"}, "prompt_field='prompt'", "'12'"),
        ({"prompt": ["a", "b"], "answer": "1"}, "prompt_field='prompt'", r"'\[\"a\", \"b\"\]'"),
        ({"prompt": {"text": "a"}, "answer": "1"}, "prompt_field='prompt'", '\'{"text": "a"}\''),
        ({"prompt": "a", "answer": None}, "answer_field='answer'", "'null'"),
        ({"prompt": "a", "answer": [1]}, "answer_field='answer'", r"'\[1\]'"),
    ],
)
def test_a_null_or_non_string_prompt_field_is_refused_naming_the_line(
    tmp_path: Path, record, field, shown
) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=rf"p.jsonl:2: {field} holds {shown}; expected a string"):
        JSONLPrompts(str(path))


def test_a_numeric_answer_is_kept_as_its_text(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+2=", "answer": 3}) + "\n")
    assert JSONLPrompts(str(path))[0].answer == "3"


# ---------------------------------------------------------------- rewards

ACCEPTED = [
    (1, 1.0),
    (0, 0.0),
    (0.5, 0.5),
    (np.float64(0.5), 0.5),
    (np.float32(0.5), 0.5),
    (np.float16(0.5), 0.5),
    (np.int64(2), 2.0),
    (np.uint8(2), 2.0),
    (np.array(0.5), 0.5),
    (torch.tensor(0.5), 0.5),
    (torch.tensor(0.5, dtype=torch.float64), 0.5),
    (torch.tensor(2), 2.0),
    (torch.tensor([0.5]), 0.5),
    (-MAX_REWARD, -MAX_REWARD),
]
REFUSED = [
    True,
    False,
    np.bool_(True),
    torch.tensor(True),
    None,
    "1.0",
    [1.0],
    torch.tensor([0.5, 0.5]),
    complex(1, 0),
    float("nan"),
    float("inf"),
    np.float64("-inf"),
    1e39,
    np.float64(-1e39),
    torch.tensor(1e39, dtype=torch.float64),
    10**400,
]


@pytest.mark.parametrize(("score", "expected"), ACCEPTED, ids=repr)
def test_every_real_number_type_gives_the_same_reward(score, expected) -> None:
    value = reward_value(score)
    assert type(value) is float and value == expected


@pytest.mark.parametrize("score", REFUSED, ids=repr)
def test_bools_non_numbers_and_values_beyond_float32_are_refused(score) -> None:
    with pytest.raises(ValueError, match=r"^reward function returned .*; expected a"):
        reward_value(score)


class Returns(RewardFunction):
    """Returns the scores in turn, one per call of ``__call__``."""

    def __init__(self, scores: list[object]) -> None:
        self.scores = list(scores)

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return self.scores.pop(0)  # type: ignore[return-value]

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        return True


def _score(scores: list[object]):
    n = len(scores)
    ids = TOKENIZER("1", add_special_tokens=False)["input_ids"]
    out = GenerationOutput(
        prompt_ids=[list(ids)] * n,
        response_ids=[list(ids)] * n,
        logprobs=[[0.0]] * n,
        versions=[[0]] * n,
        prompt_index=[0] * n,
        finish_reason=["stop"] * n,
    )
    return score_and_pad(out, [Prompt("q", "1")], TOKENIZER, Returns(scores), 0, 0)


def test_a_batch_scores_every_numeric_type_alike_and_drops_the_rest(caplog) -> None:
    accepted = [score for score, _ in ACCEPTED]
    batch = _score(accepted)
    assert batch.scores.tolist() == [float(np.float32(e)) for _, e in ACCEPTED]
    assert batch.info["dropped_reward_error"] == 0.0
    with caplog.at_level(logging.WARNING):
        batch = _score([0.25, 1e39, np.float32(0.5), True])
    assert batch.scores.tolist() == [0.25, 0.5]
    assert torch.isfinite(batch.rewards).all()
    assert batch.info["generated"] == 4.0 and batch.info["dropped_reward_error"] == 2.0
    # one warning per distinct error, with its count (console.ErrorsOnce)
    assert "reward function returned 1e+39" in caplog.text and "float32's range" in caplog.text
    assert "reward function returned True" in caplog.text and "on 1 of 4 samples" in caplog.text


# ---------------------------------------------------------------- the calculator


@pytest.mark.parametrize(
    ("expression", "exact"),
    [
        ("0.1+0.2", Fraction(3, 10)),
        ("0.12345678901234567890", Fraction(12345678901234567890, 10**20)),
        ("123456789012345678.5", Fraction(246913578024691357, 2)),
        ("0.1*3-0.3", Fraction(0)),
        ("1e400/1e399", Fraction(10)),
        ("1.5e-3", Fraction(3, 2000)),
        ("1_000.25", Fraction(4001, 4)),
        (".5+5.", Fraction(11, 2)),
    ],
)
def test_the_calculator_reads_decimal_literals_exactly(expression, exact) -> None:
    assert safe_eval(expression) == exact


def test_the_calculator_bounds_literals_before_building_them() -> None:
    for expression in ("1e100000000", "1e-100000000", "1e1001"):
        with pytest.raises(CalculatorError, match="number out of range"):
            safe_eval(expression)
    env = CalculatorEnv()
    assert env.observe(Prompt("q", "1"), "<calc>0.1+0.2</calc>") == "<result>0.3</result>"
    assert env.observe(Prompt("q", "1"), "<calc>2.675*100</calc>") == "<result>267.5</result>"
