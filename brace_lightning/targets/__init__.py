"""Value targets: PPO-GAE, V-trace and BRACE for a critic; GRPO, Dr. GRPO and RLOO without one."""

from brace_lightning.targets.estimators import (
    BRACE,
    GAE,
    GRPO,
    RLOO,
    DrGRPO,
    GroupRelative,
    ValueTarget,
    VTrace,
)
from brace_lightning.targets.functional import ValueTargets
from brace_lightning.targets.groups import group_advantages

__all__ = [
    "BRACE",
    "GAE",
    "GRPO",
    "RLOO",
    "DrGRPO",
    "GroupRelative",
    "VTrace",
    "ValueTarget",
    "ValueTargets",
    "group_advantages",
]
