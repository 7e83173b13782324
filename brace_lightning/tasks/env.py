"""The multi-turn environment interface: tool calls, observations and the episode's verifier.

An episode is a prompt followed by a *transcript* that alternates policy text and environment
observations::

    prompt | policy: "... <calc>48/2</calc>" | env: "<result>24</result>" | policy: "... #### 24<eos>"

The policy's turn ends when it writes one of :attr:`ToolEnvironment.stop_strings` (the closing
marker of a tool call) or eos. At a closing marker the rollout loop (``rollout/multiturn.py``) asks
:meth:`ToolEnvironment.observe` for the observation, tokenizes it and appends it as
*environment tokens* (``mask`` False: not actions, so the value targets see a hole and γ, λ and k
count the policy's tokens only), then generation continues. ``observe`` returning None ends the
episode (e.g. at ``</answer>``). The episode also ends at eos, after ``max_response_tokens``
transcript tokens (observations included), or when the policy closes a tool call beyond
``max_turns`` (no observation is given, finish reason ``"length"``).

An environment is also the episode's :class:`~brace_lightning.tasks.base.RewardFunction`: it scores
the decoded transcript (observations included, so that it can tell them apart from the policy's own
text), with ``collect_rollouts``'s semantics: the reward sits on the last action token, and a verifier
error drops the sample and is counted. Environments are plain picklable objects (a producer process
receives them), configured in YAML with ``class_path``.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Sequence

from brace_lightning.checks import require_int
from brace_lightning.tasks.base import Prompt, RewardFunction


class ToolEnvironment(RewardFunction):
    """Base class of multi-turn tool environments; subclasses set the tool and the verifier.

    Args:
        max_turns: tool calls answered per episode (observations appended); a call beyond it ends
            the episode unanswered.
        max_response_tokens: budget of transcript tokens per episode (policy and observation
            tokens); the episode ends when it is reached, and an observation that would not fit
            ends the episode instead of being appended.
    """

    def __init__(self, *, max_turns: int = 4, max_response_tokens: int = 256) -> None:
        require_int("max_turns", max_turns, 0)
        require_int("max_response_tokens", max_response_tokens, 1)
        self.max_turns = max_turns
        self.max_response_tokens = max_response_tokens

    @property
    @abstractmethod
    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end the policy's turn (closing markers of tool calls and final answers)."""

    @abstractmethod
    def observe(self, prompt: Prompt, transcript: str) -> str | None:
        """The observation that answers the tool call ``transcript`` ends with, or None (done).

        Args:
            prompt: the episode's prompt.
            transcript: the decoded response so far (policy text and earlier observations); it ends
                with one of :attr:`stop_strings`.

        Returns:
            Text appended as environment tokens (an error message for a malformed call, never an
            exception), or None when the closing marker ends the episode (a final answer).
        """

    def error_observation(self, message: str) -> str:
        """The observation shown when :meth:`observe` itself fails (the rollout loop catches the
        exception, counts it in ``tool_errors`` and appends this instead); subclasses wrap it in
        their tool's result markers."""
        return f"error: {message}"


def strip_blocks(text: str, tags: Sequence[str]) -> str:
    """``text`` without its ``<tag>...</tag>`` blocks (unclosed ones run to the end), for each tag.

    Verifiers use it to drop tool calls and observations before reading the policy's final answer.
    """
    for tag in tags:
        open_, close = re.escape(f"<{tag}>"), re.escape(f"</{tag}>")
        text = re.sub(rf"{open_}.*?(?:{close}|\Z)", " ", text, flags=re.DOTALL)
    return text


def last_call(transcript: str, tag: str) -> str | None:
    """The argument of the last ``<tag>...</tag>`` call that ``transcript`` ends with, or None."""
    close = f"</{tag}>"
    if not transcript.endswith(close):
        return None
    head = transcript[: -len(close)]
    start = head.rfind(f"<{tag}>")
    return None if start < 0 else head[start + len(tag) + 2 :]
