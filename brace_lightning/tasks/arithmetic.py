"""Procedurally generated integer arithmetic with an exact verifier and a step-by-step answer format.

A prompt is an expression followed by ``=``; the reference solution evaluates it one operation at a
time, separated by ``;``, then gives the final answer after ``#`` (the model ends it with eos)::

    prompt:    12+7+5=
    solution:  12+7=19;19+5=24#24

The response length is dialled by the number of operands (one step per operation) and by
``max_value`` (digits per number). Expressions are evaluated left to right; when ``*`` follows a
``+``/``-`` the prompt parenthesises the left part (``(2+3)*4=``), so usual precedence gives the same
value. Operands are drawn uniformly from ``[0, max_value]``; intermediate results may be negative.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from brace_lightning.checks import require_bool
from brace_lightning.seeds import run_seed
from brace_lightning.tasks.base import GeneratedTask, Prompt, RewardFunction

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INTEGER = re.compile(r"-?\d+")
_MAX_ANSWER_CHARS = 1000


def solve(operands: Sequence[int], ops: Sequence[str]) -> tuple[str, str, int]:
    """Expression, step-by-step solution and value of ``operands[0] ops[0] operands[1] ...``.

    Args:
        operands: ``k ≥ 2`` non-negative integers.
        ops: ``k − 1`` operators from ``"+-*"``, applied left to right.

    Returns:
        ``(expression, solution, value)``, e.g. ``("12+7+5", "12+7=19;19+5=24#24", 24)``.
    """
    if len(operands) < 2 or len(ops) != len(operands) - 1:
        raise ValueError(
            f"solve got {len(operands)} operands and {len(ops)} operators; expected k >= 2 operands "
            "and k - 1 operators."
        )
    expression, additive_on_top = str(operands[0]), False
    value, steps = operands[0], []
    for op, operand in zip(ops, operands[1:], strict=True):
        if op not in _OPS:
            raise ValueError(f"solve got operator {op!r}; expected one of '+', '-', '*'.")
        if op == "*" and additive_on_top:
            expression, additive_on_top = f"({expression})", False
        expression += f"{op}{operand}"
        additive_on_top = additive_on_top or op != "*"
        result = _OPS[op](value, operand)
        steps.append(f"{value}{op}{operand}={result}")
        value = result
    return expression, ";".join(steps) + f"#{value}", value


def parse_final_answer(completion: str) -> int | None:
    """The integer after the last ``#`` of ``completion``, or None when it is missing or malformed.

    Surrounding whitespace is ignored; anything else after the ``#`` (a second number, trailing
    text) or more than 1000 characters makes the answer malformed.
    """
    if "#" not in completion:
        return None
    tail = completion.rsplit("#", 1)[1].strip()
    # Longer digit strings are no answer to these tasks, and int() of them is slow or refused.
    return int(tail) if len(tail) <= _MAX_ANSWER_CHARS and _INTEGER.fullmatch(tail) else None


class ArithmeticTask(GeneratedTask):
    """Random arithmetic prompts with answers and reference solutions.

    Args:
        num_operands: operands per expression, an integer or an inclusive range ``(low, high)``;
            each operand adds one solution step.
        max_value: operands are drawn uniformly from ``[0, max_value]``.
        ops: the operators to draw from, a string over ``"+-*"``.
        seed: seed of the deterministic stream returned by ``iter(task)`` (None: the run's
            ``seed_everything``, see ``brace_lightning.seeds``).
        tool_calls: the reference solutions of :meth:`supervised_pairs` compute every step with the
            calculator tool of ``tasks/calculator.py`` (:meth:`tool_solution`), so a warm-started
            policy calls it; the prompts and answers are the same.
        split: ``"all"`` (every prompt), ``"train"`` (never a held-out prompt; validation then
            draws the held-out ones) or ``"held_out"`` (only those): ``tasks/split.py``.
        held_out_fraction: the share of prompt texts held out when ``split`` is not ``"all"``.
    """

    def __init__(
        self,
        num_operands: int | tuple[int, int] = (2, 3),
        max_value: int = 20,
        ops: str = "+-",
        seed: int | None = None,
        tool_calls: bool = False,
        split: str = "all",
        held_out_fraction: float = 0.1,
    ) -> None:
        low, high = (num_operands, num_operands) if isinstance(num_operands, int) else num_operands
        if not 2 <= low <= high:
            raise ValueError(
                f"ArithmeticTask got num_operands={num_operands}; expected an integer >= 2 or a "
                "range (low, high) with 2 <= low <= high."
            )
        if max_value < 1:
            raise ValueError(f"ArithmeticTask got max_value={max_value}; expected an integer >= 1.")
        if not ops or any(op not in _OPS for op in ops):
            raise ValueError(
                f"ArithmeticTask got ops={ops!r}; expected a non-empty string over '+-*'."
            )
        self.num_operands = (int(low), int(high))
        self.max_value = int(max_value)
        self.ops = ops
        self.seed = run_seed(seed)
        require_bool("tool_calls", tool_calls)
        self.tool_calls = tool_calls
        self.set_split(split, held_out_fraction)

    def draw(self, generator: torch.Generator) -> Prompt:
        """One random prompt drawn with ``generator``."""
        low, high = self.num_operands
        k = int(torch.randint(low, high + 1, (), generator=generator))
        operands = torch.randint(0, self.max_value + 1, (k,), generator=generator).tolist()
        op_index = torch.randint(0, len(self.ops), (k - 1,), generator=generator).tolist()
        ops = [self.ops[i] for i in op_index]
        expression, solution, value = solve(operands, ops)
        return Prompt(
            text=f"{expression}=",
            answer=str(value),
            metadata={"operands": operands, "ops": ops, "solution": solution},
        )

    @staticmethod
    def solution(prompt: Prompt) -> str:
        """The reference step-by-step completion of an arithmetic ``prompt`` (without eos)."""
        return solve(prompt.metadata["operands"], prompt.metadata["ops"])[1]

    @staticmethod
    def tool_solution(prompt: Prompt) -> str:
        """The reference completion with one calculator call per step, its results included::

            12+7+5=  ->  <calc>12+7</calc><result>19</result><calc>19+5</calc><result>24</result>#24

        (A supervised warm start on it also fits the result tokens; in rollouts the calculator
        environment writes them, as environment tokens.)
        """
        operands, ops = prompt.metadata["operands"], prompt.metadata["ops"]
        value, steps = operands[0], []
        for op, operand in zip(ops, operands[1:], strict=True):
            result = _OPS[op](value, operand)
            steps.append(f"<calc>{value}{op}{operand}</calc><result>{result}</result>")
            value = result
        return "".join(steps) + f"#{value}"

    def reference(self, prompt: Prompt) -> str:
        """The warm start's completion: :meth:`tool_solution` with ``tool_calls``, else
        :meth:`solution`."""
        return self.tool_solution(prompt) if self.tool_calls else self.solution(prompt)


class ArithmeticReward(RewardFunction):
    """Exact-match reward on the integer after the last ``#``.

    Reward: 1.0 when the final answer equals ``prompt.answer``; ``format_reward`` when it is a
    well-formed integer but wrong; 0.0 when it is missing or malformed (see
    :func:`parse_final_answer`). The intermediate steps are not checked.

    Args:
        format_reward: shaping reward for a well-formed wrong answer, in ``[0, 1)``; 0 disables it.
    """

    def __init__(self, format_reward: float = 0.0) -> None:
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(
                f"ArithmeticReward got format_reward={format_reward}; expected a value in [0, 1)."
            )
        self.format_reward = float(format_reward)

    def __call__(self, prompt: Prompt, completion: str) -> float:
        answer = parse_final_answer(completion)
        if answer is None:
            return 0.0
        return 1.0 if answer == int(prompt.answer) else self.format_reward

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether the final answer equals ``prompt.answer`` exactly."""
        return parse_final_answer(completion) == int(prompt.answer)
