"""An example of your own reward function, used by ``examples/my_prompts.jsonl``'s recipe.

Copy this file next to where you run ``brace-lightning`` (the working directory is on the module
path) and select it in a recipe or on the command line::

    brace-lightning fit --config configs/quickstart.yaml --config configs/tasks/my_prompts.yaml \\
        --data.reward my_reward.ExactMatch

A reward function gets the :class:`~brace_lightning.tasks.Prompt` (``text``, ``answer``, and every
other field of your record in ``metadata``) and the decoded completion; it returns a float placed on
the last response token. It may raise: that sample is then dropped and counted
(``data/dropped_reward_error``), never given a made-up reward.
"""

from __future__ import annotations

from brace_lightning.tasks import Prompt, RewardFunction


class ExactMatch(RewardFunction):
    """1.0 when the completion's first line equals the reference answer, else 0.0.

    Args:
        case_sensitive: compare letters exactly (default: ignore case).
        length_penalty: subtracted per character after the first line (0 = none), a simple example
            of shaping; ``is_correct`` still counts only exact matches.
    """

    def __init__(self, case_sensitive: bool = False, length_penalty: float = 0.0) -> None:
        if length_penalty < 0:
            raise ValueError(f"length_penalty={length_penalty}; expected a number >= 0.")
        self.case_sensitive = case_sensitive
        self.length_penalty = length_penalty

    def _answer(self, completion: str) -> str:
        first = completion.strip().split("\n", 1)[0].strip()
        return first if self.case_sensitive else first.lower()

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        reference = prompt.answer.strip()
        return self._answer(completion) == (reference if self.case_sensitive else reference.lower())

    def __call__(self, prompt: Prompt, completion: str) -> float:
        rest = completion.strip().split("\n", 1)[1:] or [""]
        return float(self.is_correct(prompt, completion)) - self.length_penalty * len(rest[0])
