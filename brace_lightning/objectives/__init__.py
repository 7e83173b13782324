"""Actor-side objectives and the critic loss.

Pure math (torch only): :mod:`.functional` holds one function per formula; the config classes here
carry hyperparameters, validate them and call it. Select one in YAML with ``class_path``.
"""

from brace_lightning.objectives.actor import (
    DIS,
    ESTR,
    GSPO,
    PPOEWMA,
    TIS,
    DecoupledPPO,
    IcePop,
    KPop,
    PPOClip,
)
from brace_lightning.objectives.base import ActorObjective, ObjectiveOutput
from brace_lightning.objectives.critic import CriticLoss

__all__ = [
    "DIS",
    "ESTR",
    "GSPO",
    "PPOEWMA",
    "TIS",
    "ActorObjective",
    "CriticLoss",
    "DecoupledPPO",
    "IcePop",
    "KPop",
    "ObjectiveOutput",
    "PPOClip",
]
