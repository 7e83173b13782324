"""Rollout engines, sample/batch types and rollout collection (single- and multi-turn)."""

from brace_lightning.rollout.collect import collect_rollouts
from brace_lightning.rollout.embedded import EmbeddedEngine
from brace_lightning.rollout.engine import GenerationOutput, RolloutEngine
from brace_lightning.rollout.multiturn import collect_episodes
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.rollout.vllm import VLLMEngine

__all__ = [
    "EmbeddedEngine",
    "GenerationOutput",
    "RolloutBatch",
    "RolloutEngine",
    "VLLMEngine",
    "collect_episodes",
    "collect_rollouts",
]
