"""A calculator tool for GSM8K-style problems (the paper's GSM8K-Tool task), with an exact verifier.

The policy calls the calculator with ``<calc>EXPRESSION</calc>``; the environment appends
``<result>VALUE</result>`` (or ``<result>error: ...</result>``) and the policy continues::

    Question: ... How many marbles does Mara have now?
    Answer: <calc>14+9-5</calc><result>18</result> She has 18 marbles.
    #### 18<eos>

Every character is in the character tokenizer's vocabulary, so the tiny CPU models can use it.
Expressions are evaluated exactly (:class:`fractions.Fraction`) by walking a whitelisted Python AST:
numbers (a decimal literal is read from its text, so ``0.1`` is exactly 1/10 and a literal with more
digits than a float holds keeps them all), ``+ - * /``, parentheses and unary signs; nothing is ever passed to ``eval``. A bad call
(syntax, a name, ``**``, division by zero, more than :data:`MAX_EXPRESSION_CHARS` characters, a
value with more than :data:`MAX_DIGITS` digits) gets an error observation, not an exception, and
the work per call is bounded by those two limits.

The verifier reads the final answer as :class:`~brace_lightning.tasks.gsm8k.GSM8KReward` does
(:func:`~brace_lightning.tasks.gsm8k.extract_final_answer`, compared with ``answers_match``) from the
transcript with its ``<calc>`` and ``<result>`` blocks removed, so a number the calculator printed
is never mistaken for the policy's answer. Arithmetic-task answers (``...#24``) and GSM8K answers
(``#### 24``) both work.
"""

from __future__ import annotations

import ast
import math
from decimal import Decimal, localcontext
from fractions import Fraction

from brace_lightning.tasks.base import Prompt
from brace_lightning.tasks.env import ToolEnvironment, last_call, strip_blocks
from brace_lightning.tasks.gsm8k import answers_match, extract_final_answer

#: Longest expression the calculator evaluates.
MAX_EXPRESSION_CHARS = 200
#: Most decimal digits of any exact intermediate value (numerator or denominator); beyond it the
#: call gets ``error: number out of range``. ``1e308`` alone has 309, so a few such factors reach it.
MAX_DIGITS = 1000
_MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
_UNARY = {ast.USub: lambda a: -a, ast.UAdd: lambda a: a}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is shown to the policy."""


def _bounded(value: Fraction) -> Fraction:
    if max(abs(value.numerator).bit_length(), value.denominator.bit_length()) > _MAX_BITS:
        raise CalculatorError("number out of range")
    return value


def _literal(text: str) -> Fraction:
    """The exact value of a decimal literal as written (``0.1`` is 1/10, ``1e400`` is 10**400):
    Python's parser would round it to a float first."""
    try:
        value = Decimal(text)
    except ArithmeticError:
        raise CalculatorError(f"unsupported constant {text!r}") from None
    if (
        not value.is_finite()
        or abs(int(value.as_tuple().exponent)) > MAX_DIGITS + MAX_EXPRESSION_CHARS
    ):
        raise CalculatorError("number out of range")  # checked before 10**exponent is built
    return _bounded(Fraction(value))


def _evaluate(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, source)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"unsupported constant {node.value!r}")
        if isinstance(node.value, float):
            return _literal(ast.get_source_segment(source, node) or repr(node.value))
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, source))
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        raise CalculatorError(f"unsupported operator {type(node.op).__name__}")
    raise CalculatorError(f"unsupported {type(node).__name__}")


def format_number(value: Fraction, *, places: int = 6) -> str:
    """``value`` as an integer when it is one, else a decimal rounded to ``places`` places
    (trailing zeros dropped): ``Fraction(49, 2)`` → ``"24.5"``, ``Fraction(1, 3)`` → ``"0.333333"``."""
    if value.denominator == 1:
        return str(value.numerator)
    with localcontext() as context:  # enough digits for the integer part and the places
        context.prec = len(str(abs(value.numerator))) + places + 2
        rounded = (Decimal(value.numerator) / Decimal(value.denominator)).quantize(
            Decimal(1).scaleb(-places)
        )
    text = format(rounded, "f").rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def safe_eval(expression: str) -> Fraction:
    """The exact value of an arithmetic ``expression`` over numbers, ``+ - * /``, parentheses and
    unary ``+``/``-``.

    Raises:
        CalculatorError: for anything else (names, calls, ``**``, ``%``, comparisons...), bad
            syntax, division by zero, more than :data:`MAX_EXPRESSION_CHARS` characters, or a value
            (any intermediate one too) with more than :data:`MAX_DIGITS` digits.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    source = expression.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise CalculatorError("invalid expression") from None
    return _evaluate(tree, source)


class CalculatorEnv(ToolEnvironment):
    """Calculator tool environment with the GSM8K final-answer verifier.

    Args:
        max_turns: calculator calls answered per episode.
        max_response_tokens: transcript token budget per episode (observations included).
        strict: only accept a final answer written after ``####``; when False the last number of the
            policy's own text counts if there is no ``####`` (arithmetic-task answers ``#24``).
        places: decimal places of non-integer results.
    """

    def __init__(
        self,
        *,
        max_turns: int = 4,
        max_response_tokens: int = 256,
        strict: bool = False,
        places: int = 6,
    ) -> None:
        super().__init__(max_turns=max_turns, max_response_tokens=max_response_tokens)
        if isinstance(places, bool) or not isinstance(places, int) or places < 0:
            raise ValueError(f"places must be an integer >= 0; got {places!r}.")
        self.strict = bool(strict)
        self.places = places

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return ("</calc>",)

    def observe(self, prompt: Prompt, transcript: str) -> str | None:
        """``<result>VALUE</result>`` for the ``<calc>...</calc>`` call ``transcript`` ends with."""
        expression = last_call(transcript, "calc")
        if expression is None:
            return "<result>error: no <calc> before </calc></result>"
        try:
            value = format_number(safe_eval(expression), places=self.places)
        except CalculatorError as error:
            return f"<result>error: {error}</result>"
        return f"<result>{value}</result>"

    def error_observation(self, message: str) -> str:
        return f"<result>error: {message}</result>"

    def final_answer(self, transcript: str) -> str | None:
        """The policy's final answer: the transcript without calculator calls and results, read by
        :func:`~brace_lightning.tasks.gsm8k.extract_final_answer`."""
        text = strip_blocks(transcript, ("calc", "result"))
        if self.strict and "####" not in text:
            return None
        return extract_final_answer(text)

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if self.is_correct(prompt, completion) else 0.0

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether the final answer equals ``prompt.answer`` numerically."""
        return answers_match(self.final_answer(completion), prompt.answer)
