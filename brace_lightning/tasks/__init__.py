"""Prompt sources and verifiers: arithmetic, GSM8K, and the interfaces users implement."""

from brace_lightning.tasks.arithmetic import ArithmeticReward, ArithmeticTask
from brace_lightning.tasks.base import Prompt, PromptSource, RewardFunction
from brace_lightning.tasks.gsm8k import GSM8K, GSM8KReward

__all__ = [
    "GSM8K",
    "ArithmeticReward",
    "ArithmeticTask",
    "GSM8KReward",
    "Prompt",
    "PromptSource",
    "RewardFunction",
]
