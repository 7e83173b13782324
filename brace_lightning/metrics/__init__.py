"""torchmetrics for asynchronous PPO: critic bias (ĝ_π, b̂, β), importance weights, staleness.

Pure per-action bookkeeping (action index, remaining horizon, return-to-go) is in
:mod:`~brace_lightning.metrics.functional`.
"""

from brace_lightning.metrics.critic import (
    Binned,
    HorizonBeta,
    SeparationByPosition,
    ValueBiasGap,
    power_of_two_edges,
)
from brace_lightning.metrics.rollout import (
    ImportanceWeightStats,
    StalenessHistogram,
    StalenessSummary,
)

__all__ = [
    "Binned",
    "HorizonBeta",
    "ImportanceWeightStats",
    "SeparationByPosition",
    "StalenessHistogram",
    "StalenessSummary",
    "ValueBiasGap",
    "power_of_two_edges",
]
