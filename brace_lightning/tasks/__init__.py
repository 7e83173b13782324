"""Prompt sources, verifiers and multi-turn tool environments: arithmetic, counting, GSM8K, calculator tool,
BM25 retrieval QA, your own prompts from JSONL files or Hugging Face datasets, a learned reward model,
and the interfaces users implement."""

from brace_lightning.tasks.arithmetic import ArithmeticReward, ArithmeticTask
from brace_lightning.tasks.base import (
    BatchedReward,
    GeneratedTask,
    Prompt,
    PromptList,
    PromptSource,
    RewardFunction,
)
from brace_lightning.tasks.calculator import CalculatorEnv
from brace_lightning.tasks.counting import CountingReward, CountingTask
from brace_lightning.tasks.env import ToolEnvironment
from brace_lightning.tasks.gsm8k import GSM8K, GSM8KReward
from brace_lightning.tasks.prompts import HFPrompts, JSONLPrompts
from brace_lightning.tasks.retrieval import BM25, RetrievalEnv, RetrievalQA
from brace_lightning.tasks.reward_model import RewardModel

__all__ = [
    "BM25",
    "GSM8K",
    "ArithmeticReward",
    "ArithmeticTask",
    "BatchedReward",
    "CalculatorEnv",
    "CountingReward",
    "CountingTask",
    "GSM8KReward",
    "GeneratedTask",
    "HFPrompts",
    "JSONLPrompts",
    "Prompt",
    "PromptList",
    "PromptSource",
    "RetrievalEnv",
    "RetrievalQA",
    "RewardFunction",
    "RewardModel",
    "ToolEnvironment",
]
