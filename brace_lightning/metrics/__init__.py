"""torchmetrics for asynchronous PPO: critic bias (ĝ_π, b̂, β), the critic's proper score,
importance weights, staleness.

Pure per-action bookkeeping (action index, remaining horizon, return-to-go) is in
:mod:`~brace_lightning.metrics.functional`.
"""

from brace_lightning.metrics.critic import (
    CRITIC_SCORE_EDGES,
    Binned,
    HorizonBeta,
    SeparationByPosition,
    SignedValueBias,
    ValueBiasGap,
    ValueSquaredError,
    critic_scores,
    power_of_two_edges,
)
from brace_lightning.metrics.rollout import (
    ImportanceWeightStats,
    StalenessHistogram,
    StalenessSummary,
)

__all__ = [
    "CRITIC_SCORE_EDGES",
    "Binned",
    "HorizonBeta",
    "ImportanceWeightStats",
    "SeparationByPosition",
    "StalenessHistogram",
    "StalenessSummary",
    "SignedValueBias",
    "ValueBiasGap",
    "ValueSquaredError",
    "critic_scores",
    "power_of_two_edges",
]
