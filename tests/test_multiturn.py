"""Multi-turn tool environments: the calculator, BM25 retrieval, the episode loop and its batches."""

from __future__ import annotations

import builtins
import math
import pickle
import random
import re
import time
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from brace_lightning.cli import run
from brace_lightning.data import AsyncRolloutDataModule, RolloutDataModule
from brace_lightning.logs import read_scalars
from brace_lightning.models.policy import token_logprobs
from brace_lightning.models.sources import load_actor
from brace_lightning.models.tokenizer import build_char_tokenizer
from brace_lightning.rollout.embedded import EmbeddedEngine
from brace_lightning.rollout.engine import GenerationOutput, RolloutEngine
from brace_lightning.rollout.multiturn import collect_episodes
from brace_lightning.targets.functional import brace, gae, vtrace
from brace_lightning.tasks import (
    BM25,
    ArithmeticReward,
    ArithmeticTask,
    CalculatorEnv,
    Prompt,
    RetrievalEnv,
    RetrievalQA,
    ToolEnvironment,
)
from brace_lightning.tasks.arithmetic import parse_final_answer
from brace_lightning.tasks.calculator import CalculatorError, format_number, safe_eval
from brace_lightning.tasks.env import strip_blocks
from brace_lightning.tasks.gsm8k import load_gsm8k_jsonl
from brace_lightning.tasks.retrieval import bm25_tokenize, exact_match, normalize_answer
from tests.test_trainer import CONFIGS, small_run

GSM8K_FIXTURE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"
EOS = "\x00"  # stands for the eos token in scripted responses


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("48/2", Fraction(24)),
        (" 14 + 9 - 5 ", Fraction(18)),
        ("(2+3)*4", Fraction(20)),
        ("-3*-(2)", Fraction(6)),
        ("+7", Fraction(7)),
        ("1/3", Fraction(1, 3)),
        ("0.1+0.2", Fraction(3, 10)),  # exact, not 0.30000000000000004
        ("1.25*4", Fraction(5)),
        ("10/4*2", Fraction(5)),
    ],
)
def test_safe_eval_computes_exactly(expression, value, monkeypatch):
    def no_eval(*args, **kwargs):
        raise AssertionError("safe_eval must not call eval")

    monkeypatch.setattr(builtins, "eval", no_eval)
    assert safe_eval(expression) == value


@pytest.mark.parametrize(
    ("expression", "match"),
    [
        ("__import__('os').system('echo hi')", "unsupported Call"),
        ("open('/etc/passwd').read()", "unsupported Call"),
        ("(1).__class__", "unsupported Attribute"),
        ("x + 1", "unsupported Name"),
        ("2**100000000", "unsupported operator Pow"),
        ("7 % 3", "unsupported operator Mod"),
        ("7 // 3", "unsupported operator FloorDiv"),
        ("~5", "unsupported operator Invert"),
        ("1 < 2", "unsupported Compare"),
        ("[1, 2]", "unsupported List"),
        ("3,4", "unsupported Tuple"),
        ("lambda: 1", "unsupported Lambda"),
        ("'12'", "unsupported constant"),
        ("True + 1", "unsupported constant"),
        ("1e1001", "out of range"),  # beyond MAX_DIGITS; 1e999 is exact now
        ("1/0", "division by zero"),
        ("5/(2-2)", "division by zero"),
        ("", "invalid expression"),
        ("2 +* 3", "invalid expression"),
        ("1+" * 150 + "1", "longer than 200"),
    ],
)
def test_safe_eval_refuses_everything_else(expression, match):
    with pytest.raises(CalculatorError, match=match):
        safe_eval(expression)


def test_format_number():
    assert format_number(Fraction(24)) == "24" and format_number(Fraction(-5)) == "-5"
    assert format_number(Fraction(49, 2)) == "24.5" and format_number(Fraction(1, 3)) == "0.333333"
    assert format_number(Fraction(2, 3), places=2) == "0.67"
    assert format_number(Fraction(-1, 10**9)) == "0"
    assert format_number(Fraction(10**40 + 1, 2)) == "5" + "0" * 39 + ".5"  # beyond float digits


def test_calculator_observations_never_raise():
    env = CalculatorEnv()
    assert env.stop_strings == ("</calc>",)
    prompt = Prompt("q", "1")
    assert env.observe(prompt, "So <calc>48/2</calc>") == "<result>24</result>"
    assert env.observe(prompt, "<calc>1</calc> then <calc>7/2</calc>") == "<result>3.5</result>"
    assert env.observe(prompt, "<calc>1/0</calc>") == "<result>error: division by zero</result>"
    assert "error: unsupported Call" in env.observe(prompt, "<calc>exit()</calc>")
    assert "error: no <calc>" in env.observe(prompt, "just </calc>")


def test_calculator_bounds_the_size_of_every_value():
    """Issue 17.1: 85 policy-written characters made ``format_number`` raise (4300-digit limit)."""
    env, prompt = CalculatorEnv(), Prompt("q", "1")
    call = "<calc>" + "1e308*" * 14 + "1</calc>"
    assert env.observe(prompt, call) == "<result>error: number out of range</result>"
    tiny = "<calc>1" + "/1e300" * 20 + "</calc>"  # the denominator grows instead
    assert env.observe(prompt, tiny) == "<result>error: number out of range</result>"
    assert (
        env.observe(prompt, "<calc>1e308*1e308*1e308</calc>")
        == "<result>1" + "0" * 924 + "</result>"
    )
    hostile = [  # each at most MAX_EXPRESSION_CHARS: the work per call is bounded, and small
        "9" * 200,
        "(" * 99 + "1" + ")" * 99,
        "-" * 199 + "1",
        ("1e308*" * 34)[:199] + "1",
        ("1/3+" * 50)[:199] + "1",
        ("1e-308/" * 29)[:199] + "1",
        ("99999999999*" * 17)[:199] + "9",
    ]
    for expression in hostile:
        start = time.perf_counter()
        assert env.observe(prompt, f"<calc>{expression}</calc>").startswith("<result>")
        assert time.perf_counter() - start < 0.05, expression


class BrokenToolEnv(CalculatorEnv):
    def observe(self, prompt: Prompt, transcript: str) -> str | None:
        if transcript.endswith("<calc>2</calc>"):
            raise RuntimeError("tool backend down")
        return super().observe(prompt, transcript)


def test_observe_failures_become_error_observations_and_are_counted(tokenizer, caplog):
    script = {"a": ["<calc>2</calc>", "<calc>3</calc>", "#3" + EOS], "b": ["#1" + EOS]}
    prompts = [Prompt("a", "3"), Prompt("b", "1")]
    batch = collect_episodes(ScriptedEngine(tokenizer, script), prompts, tokenizer, BrokenToolEnv())
    assert batch.info["tool_errors"] == 1 and batch.info["generated"] == 2
    assert "tool backend down" in caplog.text
    text = tokenizer.decode(batch.input_ids[0][batch.attention_mask[0]], skip_special_tokens=True)
    assert "<calc>2</calc><result>error: the tool failed (RuntimeError)</result>" in text
    assert "<calc>3</calc><result>3</result>#3" in text  # the episode went on
    assert batch.rewards[0].sum() == 1.0


def test_answer_extraction_is_linear_and_matches_the_regex():
    """Issue 17.1: ``<answer>(.*?)</answer>`` took seconds on 64k characters of unclosed tags."""
    hostile = "<answer>" * 8000  # 64,000 characters
    start = time.perf_counter()
    assert RetrievalEnv.final_answer(hostile) is None
    assert RetrievalEnv.final_answer(hostile + "x</answer>") == "<answer>" * 7999 + "x"
    assert time.perf_counter() - start < 0.2
    rng = random.Random(0)
    pieces = ["<answer>", "</answer>", "<info>", "</info>", "a", "b "]
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        found = re.findall(r"<answer>(.*?)</answer>", strip_blocks(text, ("info",)), re.S)
        assert RetrievalEnv.final_answer(text) == (found[-1] if found else None), text
    assert parse_final_answer("#" + "9" * 5000) is None  # int() would refuse 4300+ digits


def test_calculator_verifier_reads_the_policy_answer_only():
    env = CalculatorEnv()
    prompt = Prompt("12+7=", "19")
    assert env(prompt, "<calc>12+7</calc><result>19</result>#19") == 1.0
    assert env(prompt, "12+7=19#19") == 1.0  # no tool call needed
    assert env(prompt, "<calc>12+7</calc><result>19</result>") == 0.0  # the tool's number is not it
    assert env(prompt, "<calc>12+7</calc><result>19</result>#20") == 0.0
    assert env(prompt, "#19 <calc>1+1") == 1.0  # an unclosed call is not read either
    strict = CalculatorEnv(strict=True)
    assert strict(prompt, "#19") == 0.0 and strict(prompt, "#### 19") == 1.0
    for gsm in load_gsm8k_jsonl(GSM8K_FIXTURE):  # GSM8K reference solutions are correct answers
        assert env(gsm, gsm.metadata["solution"]) == 1.0
        assert env(gsm, gsm.metadata["solution"] + "<calc>1+1</calc><result>2</result>") == 1.0
    for arithmetic in ArithmeticTask(num_operands=3, ops="+-*").sample(
        20, torch.Generator().manual_seed(0)
    ):
        assert env(arithmetic, ArithmeticTask.solution(arithmetic)) == 1.0
    with pytest.raises(ValueError, match="max_turns must be an integer >= 0; got -1"):
        CalculatorEnv(max_turns=-1)
    with pytest.raises(ValueError, match="max_response_tokens must be an integer >= 1; got 0"):
        CalculatorEnv(max_response_tokens=0)


def test_arithmetic_tool_solutions_are_what_the_calculator_answers():
    env = CalculatorEnv()
    task = ArithmeticTask(num_operands=(2, 4), max_value=30, ops="+-*", tool_calls=True)
    for text, completion in task.supervised_pairs(30):
        prompt = Prompt(text, "")
        calls = completion.split("</calc>")[:-1]
        transcript = ""
        for call, rest in zip(calls, completion.split("</calc>")[1:], strict=True):
            transcript += call.split("</result>")[-1] + "</calc>"
            observation = env.observe(prompt, transcript)
            assert rest.startswith(observation)
            transcript += observation
    pairs = task.supervised_pairs(5)
    plain = ArithmeticTask(num_operands=(2, 4), max_value=30, ops="+-*").supervised_pairs(5)
    assert [p for p, _ in pairs] == [p for p, _ in plain]  # same prompts, other solutions
    assert all("<calc>" in c for _, c in pairs) and not any("<calc>" in c for _, c in plain)
    reference = ArithmeticTask(tool_calls=True).sample(1, torch.Generator().manual_seed(0))[0]
    assert env(reference, ArithmeticTask.tool_solution(reference)) == 1.0
    with pytest.raises(ValueError, match="tool_calls must be a bool; got 1"):
        ArithmeticTask(tool_calls=1)


# ---------------------------------------------------------------- BM25 retrieval


def _bm25_reference(docs: list[str], query: str, k1: float, b: float) -> list[float]:
    """The Okapi BM25 formula with Lucene's idf, written out term by term in float64."""
    tokens = [bm25_tokenize(d) for d in docs]
    n = len(docs)
    avgdl = sum(len(t) for t in tokens) / n
    out = []
    for doc in tokens:
        score = 0.0
        for q in bm25_tokenize(query):
            df = sum(q in other for other in tokens)
            if df == 0:
                continue
            idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
            tf = doc.count(q)
            score += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(doc) / avgdl))
        out.append(score)
    return out


def test_bm25_matches_the_formula_and_ranks():
    docs = [
        "The cat sat on the mat.",
        "A dog and a cat, and another cat!",
        "Dogs chase cars in the long long street of the old town, the end",
        "Nothing relevant here",
    ]
    index = BM25(docs)
    # A hand computation for the query "cat": N = 4, n(cat) = 2 -> idf = ln(1 + 2.5 / 2.5) = ln 2;
    # |d0| = 6, |d1| = 8, avgdl = (6 + 8 + 14 + 3) / 4 = 7.75.
    idf = math.log(2.0)
    d0 = idf * 1 * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 6 / 7.75))
    d1 = idf * 2 * 2.5 / (2 + 1.5 * (0.25 + 0.75 * 8 / 7.75))
    assert index.scores("cat") == pytest.approx([d0, d1, 0.0, 0.0], rel=1e-12)
    for query in ("cat dog", "the long street", "cat cat mat", "zebra"):
        for k1, b in ((1.5, 0.75), (1.2, 0.0), (2.0, 1.0)):
            expected = _bm25_reference(docs, query, k1, b)
            assert BM25(docs, k1=k1, b=b).scores(query) == pytest.approx(expected, rel=1e-12)
    assert index.search("cat", 5) == [1, 0]  # zero scores are not results
    assert index.search("zebra", 3) == []
    # b changes the ranking: length normalisation favours the short document for "the".
    assert BM25(docs, b=1.0).search("the", 1) == [0]
    assert BM25(docs, b=0.0).search("the", 1) == [2]
    assert BM25(["a b", "a b"]).search("a", 2) == [0, 1]  # ties keep corpus order
    with pytest.raises(ValueError, match="k1=0"):
        BM25(docs, k1=0)
    with pytest.raises(ValueError, match="b=1.5"):
        BM25(docs, b=1.5)


@pytest.mark.parametrize(
    ("predicted", "answers", "expected"),
    [
        ("The Eiffel Tower.", ["Eiffel Tower"], True),
        ("  alexander   FLEMING ", ["Alexander Fleming"], True),
        ("an apple", ["Apple"], True),
        ("Tim Berners-Lee", ["Tim BernersLee"], True),
        ("Fleming", ["Alexander Fleming", "Fleming"], True),
        ("Alexander Fleming discovered it", ["Alexander Fleming"], False),
        ("Theodore", ["odore"], False),  # articles are words, not prefixes
        (None, ["x"], False),
    ],
)
def test_exact_match_normalisation(predicted, answers, expected):
    assert exact_match(predicted, answers) is expected


def test_normalize_answer():
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert normalize_answer("A an THE") == ""


def test_shipped_corpus_answers_every_shipped_question():
    env, qa = RetrievalEnv(), RetrievalQA()
    assert len(env.passages) >= 50 and len(qa) >= 30
    for prompt in qa:
        observation = env.observe(prompt, f"<search>{prompt.metadata['question']}</search>")
        assert observation.startswith("<info>") and observation.endswith("</info>")
        assert any(
            normalize_answer(a) in normalize_answer(observation) for a in prompt.metadata["answers"]
        ), prompt
        assert env(prompt, f"<answer>{prompt.answer}</answer>") == 1.0
    prompt = qa.prompts[0]
    assert env.observe(prompt, "<answer>Paris</answer>") is None  # the answer ends the episode
    assert env.observe(prompt, "<search>zzzz qqqq</search>") == "<info>no results</info>"
    # an <answer> inside an observation is not the policy's answer
    assert env(prompt, "<search>q</search><info><answer>Paris</answer></info>") == 0.0
    assert env(prompt, "<answer>Paris</answer> ... <answer>Rome</answer>") == 0.0  # the last one
    assert RetrievalEnv(top_k=3).observe(prompt, "<search>capital</search>").count("\n") == 2


def test_retrieval_files_are_validated(tmp_path):
    bad = tmp_path / "qa.jsonl"
    bad.write_text('{"question": "q", "answers": []}\n')
    with pytest.raises(ValueError, match="non-empty list of string 'answers'"):
        RetrievalQA(str(bad))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        RetrievalEnv(corpus=str(tmp_path / "nope.jsonl"))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"title": "T", "text": "the answer is forty two"}\n')
    assert RetrievalEnv(corpus=str(corpus)).observe(
        Prompt("q", "a"), "<search>answer</search>"
    ) == ("<info>T: the answer is forty two</info>")


def test_environments_pickle():
    for env in (CalculatorEnv(max_turns=3), RetrievalEnv(top_k=1)):
        clone = pickle.loads(pickle.dumps(env))
        assert type(clone) is type(env) and clone.max_turns == env.max_turns
    clone = pickle.loads(pickle.dumps(RetrievalEnv()))
    assert clone.observe(Prompt("q", "a"), "<search>penicillin</search>").startswith(
        "<info>Penicillin:"
    )


# ---------------------------------------------------------------- the episode loop


class ScriptedEngine(RolloutEngine):
    """Returns the next scripted segment of each context's prompt, one version per call.

    ``script[prompt text]`` lists the segments the policy "generates" in successive calls (``EOS``
    marks the eos token). The version goes up by one after every call, so each turn of an episode
    carries the version of the call that generated it.
    """

    def __init__(self, tokenizer, script: dict[str, list[str]], version: int = 5) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self._version = version
        self.calls: list[list[list[int]]] = []
        self.extra_stops: list[list[int]] = []

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self._version = version

    def _segment(self, context: list[int]) -> list[int]:
        text = self.tokenizer.decode(context)
        prompt = next(p for p in self.script if text.startswith(p))
        turn = sum(
            1 for c in self.calls if any(self.tokenizer.decode(x).startswith(prompt) for x in c)
        )
        pieces = self.script[prompt][turn - 1].split(EOS)
        ids = list(self.tokenizer(pieces[0])["input_ids"])
        return ids + ([self.tokenizer.eos_token_id] if len(pieces) > 1 else [])

    def generate(
        self,
        prompts: list[list[int]],
        *,
        num_samples: int = 1,
        extra_stop_token_ids: Sequence[int] = (),
    ) -> GenerationOutput:
        assert num_samples == 1
        self.calls.append(prompts)
        self.extra_stops.append(list(extra_stop_token_ids))
        responses = [self._segment(p) for p in prompts]
        out = GenerationOutput(
            prompt_ids=prompts,
            response_ids=responses,
            logprobs=[[-0.25] * len(r) for r in responses],
            versions=[[self._version] * len(r) for r in responses],
            prompt_index=list(range(len(prompts))),
            finish_reason=["stop"] * len(prompts),
            entropy=[[0.5] * len(r) for r in responses],
        )
        self._version += 1
        return out


class OldScriptedEngine(ScriptedEngine):
    """The same engine without the ``extra_stop_token_ids`` keyword (an older engine)."""

    def generate(self, prompts: list[list[int]], *, num_samples: int = 1) -> GenerationOutput:
        return super().generate(prompts, num_samples=num_samples)


def _row(batch, row: int, tokenizer) -> tuple[str, list[bool], list[int], list[float]]:
    """Decoded response, action mask, versions and behavior log-probs of ``row``'s response."""
    start = int(batch.mask[row].nonzero().min())
    end = int(batch.attention_mask[row].nonzero().max()) + 1
    ids = batch.input_ids[row, start:end].tolist()
    return (
        tokenizer.decode(ids),
        batch.mask[row, start:end].tolist(),
        batch.versions[row, start:end].tolist(),
        batch.behavior_logprobs[row, start:end].tolist(),
    )


def _expected_mask(parts: list[tuple[str, bool]]) -> list[bool]:
    return [action for text, action in parts for _ in text]


@pytest.mark.parametrize("engine_class", [ScriptedEngine, OldScriptedEngine])
def test_episode_bookkeeping(tokenizer, engine_class):
    script = {
        # a call split over two rounds ("<calc>" stops at its '>'), text after </calc> is cut
        "1+2=": ["<calc>", "1+2</calc>junk", "#3" + EOS],
        "5*6=": ["#30" + EOS],  # no tool call: one round
        "9-4=": ["<calc>9-4</calc>", "<calc>1/0</calc>", "#5" + EOS],  # two calls
    }
    prompts = [Prompt(text, str(eval(text[:-1]))) for text in script]
    engine = engine_class(tokenizer, script)
    batch = collect_episodes(engine, prompts, tokenizer, CalculatorEnv(), group_id_offset=7)

    assert len(engine.calls) == 3  # one generate call per round, batching the active episodes
    assert [len(c) for c in engine.calls] == [3, 2, 2]
    if engine_class is ScriptedEngine:
        assert engine.extra_stops == [[tokenizer.convert_tokens_to_ids(">")]] * 3
    assert batch.group_ids.tolist() == [7, 8, 9]
    assert batch.scores.tolist() == [1.0, 1.0, 1.0]
    eos = "<eos>"
    expected = [
        [("<calc>1+2</calc>", True), ("<result>3</result>", False), ("#3", True), (eos, True)],
        [("#30", True), (eos, True)],
        [
            ("<calc>9-4</calc>", True),
            ("<result>5</result>", False),
            ("<calc>1/0</calc>", True),
            ("<result>error: division by zero</result>", False),
            ("#5", True),
            (eos, True),
        ],
    ]
    # versions: the engine's version of the call that generated each turn (5, 6, 7 by round)
    round_versions = [[5] * 6 + [6] * 10 + [7] * 3, [5] * 4, [5] * 16 + [6] * 16 + [7] * 3]
    for row, parts in enumerate(expected):
        text, mask, versions, logprobs = _row(batch, row, tokenizer)
        assert text == "".join(p for p, _ in parts)
        exp_mask = [m for p, m in parts for _ in range(1 if p == eos else len(p))]
        assert mask == exp_mask
        assert [v for v, m in zip(versions, mask, strict=True) if m] == round_versions[row]
        assert all(v == -1 for v, m in zip(versions, mask, strict=True) if not m)
        assert all(lp == (-0.25 if m else 0.0) for lp, m in zip(logprobs, mask, strict=True))
        last_action = int(batch.mask[row].nonzero().max())
        assert batch.rewards[row].nonzero().flatten().tolist() == [last_action]
    assert (batch.entropy[~batch.mask] == 0).all() and (batch.entropy[batch.mask] == 0.5).all()
    assert not (batch.mask & ~batch.attention_mask).any()
    assert batch.info["mean_tool_calls"] == pytest.approx(1.0)  # (1 + 0 + 2) / 3
    observed = [len(p) for parts in expected for p, action in parts if not action]
    assert batch.info["mean_observation_tokens"] == pytest.approx(sum(observed) / 3)
    assert batch.info["truncated_fraction"] == 0.0 and batch.info["accuracy"] == 1.0


def test_max_turns_budget_and_final_answer_stop(tokenizer):
    script = {"1+2=": ["<calc>1+2</calc>", "<calc>3+0</calc>", "#3" + EOS]}
    prompt = [Prompt("1+2=", "3")]
    one = collect_episodes(
        ScriptedEngine(tokenizer, script), prompt, tokenizer, CalculatorEnv(max_turns=1)
    )
    text, mask, _, _ = _row(one, 0, tokenizer)
    # the second call is beyond max_turns: unanswered, the episode ends there
    assert text == "<calc>1+2</calc><result>3</result><calc>3+0</calc>"
    assert one.info["truncated_fraction"] == 1.0 and one.scores.tolist() == [0.0]
    assert mask[-1] and one.rewards[0, -1] == 0.0

    # budget 20: the observation (18 tokens) does not fit after the 16-token call
    short = collect_episodes(
        ScriptedEngine(tokenizer, script), prompt, tokenizer, CalculatorEnv(max_response_tokens=20)
    )
    assert (
        _row(short, 0, tokenizer)[0] == "<calc>1+2</calc>" and short.info["truncated_fraction"] == 1
    )
    # budget 10: the first segment itself is cut at 10 tokens
    cut = collect_episodes(
        ScriptedEngine(tokenizer, script), prompt, tokenizer, CalculatorEnv(max_response_tokens=10)
    )
    assert _row(cut, 0, tokenizer)[0] == "<calc>1+2<" and cut.input_ids.shape[1] == 4 + 10

    # retrieval: </answer> ends the episode; what follows it in the segment is dropped
    qa = RetrievalQA().prompts[0]
    script = {qa.text: ["<search>capital of France</search>", "<answer>Paris</answer>more" + EOS]}
    batch = collect_episodes(
        ScriptedEngine(tokenizer, script), [qa], tokenizer, RetrievalEnv(top_k=1)
    )
    text, mask, _, _ = _row(batch, 0, tokenizer)
    assert text.startswith("<search>capital of France</search><info>Paris: Paris is the capital")
    assert text.endswith("</info><answer>Paris</answer>") and mask[-1]
    assert batch.scores.tolist() == [1.0] and batch.info["truncated_fraction"] == 0.0


class RaisingCalculator(CalculatorEnv):
    def __call__(self, prompt: Prompt, completion: str) -> float:
        if prompt.answer == "boom":
            raise RuntimeError("verifier crashed")
        return super().__call__(prompt, completion)


def test_verifier_errors_drop_and_count_episodes(tokenizer, caplog):
    script = {"a": ["#1" + EOS], "b": ["<calc>1</calc>", "#1" + EOS]}
    prompts = [Prompt("a", "1"), Prompt("b", "boom")]
    batch = collect_episodes(
        ScriptedEngine(tokenizer, script), prompts, tokenizer, RaisingCalculator()
    )
    assert len(batch) == 1 and batch.group_ids.tolist() == [0]
    assert batch.info["generated"] == 2 and batch.info["dropped_reward_error"] == 1
    assert "verifier crashed" in caplog.text
    with pytest.raises(ValueError, match="num_samples=0"):
        collect_episodes(
            ScriptedEngine(tokenizer, script), prompts, tokenizer, CalculatorEnv(), num_samples=0
        )


class LetterEnv(ToolEnvironment):
    """Test environment whose tool call ends at any of a few common letters, so that a random
    tiny model calls it within a few tokens; the observation is a fixed text."""

    def __init__(self, *, max_turns: int = 3, max_response_tokens: int = 48) -> None:
        super().__init__(max_turns=max_turns, max_response_tokens=max_response_tokens)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple("aeiouxyz")

    def observe(self, prompt: Prompt, transcript: str) -> str | None:
        return "[ok]"

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return float(len(completion) % 2)


class EssEnv(LetterEnv):
    @property
    def stop_strings(self) -> tuple[str, ...]:
        return ("s",)


def test_special_tokens_never_complete_a_tool_call(tokenizer):
    # The eos token's text "<eos>" contains "s", but eos is not text: the episode just ends.
    batch = collect_episodes(
        ScriptedEngine(tokenizer, {"q": ["ab" + EOS]}), [Prompt("q", "")], tokenizer, EssEnv()
    )
    assert batch.mask[0, 1:].all() and batch.info["mean_tool_calls"] == 0.0


@pytest.fixture(scope="module")
def actor(tokenizer):
    return load_actor("tiny-char", tokenizer=tokenizer, hidden_size=64, num_layers=1, seed=0)


@pytest.mark.parametrize("env", [LetterEnv(), CalculatorEnv(max_response_tokens=40)])
def test_embedded_engine_episodes_keep_the_batch_invariants(actor, tokenizer, env):
    engine = EmbeddedEngine(actor, max_new_tokens=16, seed=0)
    prompts = ArithmeticTask().sample(3, torch.Generator().manual_seed(0))
    batch = collect_episodes(engine, prompts, tokenizer, env, num_samples=2)
    assert len(batch) == 6 and batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    response = batch.attention_mask & (batch.mask.cumsum(dim=1) > 0)
    assert not (batch.mask & ~batch.attention_mask).any()
    assert (response.sum(dim=1) <= env.max_response_tokens).all()
    observations = response & ~batch.mask
    assert (batch.versions[~batch.mask] == -1).all() and (
        batch.behavior_logprobs[~batch.mask] == 0
    ).all()
    if isinstance(env, LetterEnv):
        assert int(observations.any(dim=1).sum()) >= 4  # most rows called the tool
        for row in range(len(batch)):
            start = int(batch.mask[row].nonzero().min())
            end = int(batch.attention_mask[row].nonzero().max()) + 1
            text = tokenizer.decode(batch.input_ids[row, start:end][~batch.mask[row, start:end]])
            assert text == "[ok]" * text.count("[ok]")  # observations are exactly the env's text
    # The engine sampled every action in the context of the observations before it: the recorded
    # behavior log-probs are the actor's log-probs of the padded multi-turn rows.
    with torch.no_grad():
        logprobs, _ = token_logprobs(actor, batch.input_ids, batch.attention_mask)
    assert (logprobs - batch.behavior_logprobs)[batch.mask].abs().max() < 1e-4


def test_embedded_engine_extra_stop_token_ids_end_responses_for_one_call(actor):
    stops = list(range(40, 70))
    engine = EmbeddedEngine(actor, max_new_tokens=24, seed=1)
    prompts = [[5, 6, 7], [8, 9]]
    out = engine.generate(prompts, num_samples=4, extra_stop_token_ids=stops)
    for response, reason in zip(out.response_ids, out.finish_reason, strict=True):
        assert all(t not in stops for t in response[:-1])
        assert (reason == "stop") == (response[-1] in stops or response[-1] == 1)
    assert sum(r[-1] in stops for r in out.response_ids) >= 4
    plain = EmbeddedEngine(actor, max_new_tokens=24, seed=1).generate(prompts, num_samples=4)
    assert max(map(len, plain.response_ids)) > max(map(len, out.response_ids))  # per call only
    assert engine.stop_token_ids == [1]
    with pytest.raises(ValueError, match="extra_stop_token_ids containing 100"):
        engine.generate(prompts, extra_stop_token_ids=[100])


def test_producer_engine_wrapper_forwards_extra_stops(tokenizer):
    from brace_lightning.rollout.workers import _HookedEngine

    script = {"a": ["x" + EOS]}
    new, old = ScriptedEngine(tokenizer, script), OldScriptedEngine(tokenizer, script)
    context = [tokenizer("a")["input_ids"]]
    _HookedEngine(new, lambda: None).generate(context, extra_stop_token_ids=[7])
    _HookedEngine(old, lambda: None).generate(context, extra_stop_token_ids=[7])
    assert new.extra_stops == [[7]] and old.extra_stops == [[]]


# ---------------------------------------------------------------- value targets see holes


def test_targets_treat_observations_as_holes_and_k_counts_actions():
    torch.manual_seed(0)
    # A row: 2 prompt columns, then actions with two observations (holes) between them; and the
    # same row with the prompt and holes removed.
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)[None]
    t = mask.shape[1]
    values = torch.randn(1, t, dtype=torch.float64)
    target = -torch.rand(1, t, dtype=torch.float64)
    behavior = -torch.rand(1, t, dtype=torch.float64)
    rewards = torch.zeros(1, t, dtype=torch.float64)
    rewards[0, 13] = 1.0
    keep = mask[0]
    compact = [x[:, keep] for x in (rewards, values, target, behavior)]
    compact_mask = torch.ones(1, int(keep.sum()), dtype=torch.bool)
    for name, fn, kwargs in (
        ("brace", brace, {"k": 2, "gamma": 0.9, "lmbda": 0.8}),
        ("vtrace", vtrace, {"gamma": 0.9, "lmbda": 0.8, "rho_bar": 1.2, "c_bar": 1.1}),
        ("gae", gae, {"gamma": 0.9, "lmbda": 0.8}),
    ):
        if fn is gae:
            full = fn(rewards, values, mask, **kwargs)
            small = fn(compact[0], compact[1], compact_mask, **kwargs)
        else:
            full = fn(rewards, values, target, behavior, mask, **kwargs)
            small = fn(*compact, compact_mask, **kwargs)
        for got, want in zip(full, small, strict=True):
            assert (got[~mask] == 0).all(), name
            torch.testing.assert_close(got[mask], want[0], rtol=0, atol=1e-12, msg=name)
    # k = 2 is not a degenerate case here (it differs from the Monte-Carlo return, k = 0), so the
    # equality above shows that k counts action steps only.
    k2 = brace(rewards, values, target, behavior, mask, k=2, gamma=0.9, lmbda=0.8)
    mc = brace(rewards, values, target, behavior, mask, k=0, gamma=0.9, lmbda=0.8)
    assert not torch.allclose(k2.returns[mask], mc.returns[mask])


# ---------------------------------------------------------------- data modules and CLI


def test_data_modules_take_reward_or_env():
    task = ArithmeticTask()
    with pytest.raises(ValueError, match="reward must be a RewardFunction when env is None"):
        RolloutDataModule(task=task)
    with pytest.raises(ValueError, match="reward must be None when env is set.*CalculatorEnv"):
        RolloutDataModule(task=task, reward=ArithmeticReward(), env=CalculatorEnv())
    with pytest.raises(ValueError, match="reward must be None when env is set"):
        AsyncRolloutDataModule(task=task, reward=ArithmeticReward(), env=CalculatorEnv())
    assert isinstance(RolloutDataModule(task=task, env=CalculatorEnv()).env, CalculatorEnv)


CALCULATOR = ["--config", str(CONFIGS / "tasks" / "calculator.yaml")]


@pytest.mark.slow
def test_cli_fit_with_the_calculator_recipe(tmp_path):
    cli = run(small_run(tmp_path, *CALCULATOR, "--data.val_batches=1"))
    assert isinstance(cli.datamodule.env, CalculatorEnv) and cli.datamodule.reward is None
    assert cli.model.rollout_step == 2
    scalars = read_scalars(cli.trainer.logger.log_dir)
    for name in ("data/mean_tool_calls", "critic/loss", "actor/loss", "rollout/reward"):
        assert [step for step, _ in scalars[name]] == [1, 2], name
    assert [step for step, _ in scalars["val/reward"]] == [2]  # validation runs episodes too


@pytest.mark.slow
def test_cli_fit_with_the_retrieval_recipe(tmp_path):
    cli = run(
        small_run(
            tmp_path,
            "--config",
            str(CONFIGS / "tasks" / "retrieval.yaml"),
            "--data.env.init_args.max_response_tokens=48",
        )
    )
    assert isinstance(cli.datamodule.env, RetrievalEnv) and cli.model.rollout_step == 2


@pytest.mark.slow
@pytest.mark.parametrize("producer", ["thread", "process"])
def test_cli_fit_async_with_a_tool_environment(tmp_path, producer):
    cli = run(
        small_run(
            tmp_path,
            *CALCULATOR,
            "--config",
            str(CONFIGS / "async.yaml"),
            f"--data.producer={producer}",
            "--data.env=tests.test_multiturn.LetterEnv",
        )
    )
    assert isinstance(cli.datamodule.env, LetterEnv) and cli.model.rollout_step == 2
    scalars = read_scalars(cli.trainer.logger.log_dir)
    calls = [value for _, value in scalars["data/mean_tool_calls"]]
    assert len(calls) == 2 and all(c > 0 for c in calls)  # observations really were appended
    counts = {k: v[-1][1] for k, v in scalars.items() if k.startswith("data/count/")}
    assert counts["data/count/generated"] == (
        counts["data/count/trained"]
        + counts["data/count/dropped_stale"]
        + counts["data/count/dropped_reward_error"]
        + counts["data/count/dropped_empty"]
        + counts["data/count/buffered"]
    )
