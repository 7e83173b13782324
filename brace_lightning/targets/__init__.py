"""Value targets for the critic: PPO-GAE, V-trace and BRACE (kernels in ``functional``)."""

from brace_lightning.targets.estimators import BRACE, GAE, ValueTarget, VTrace
from brace_lightning.targets.functional import ValueTargets

__all__ = ["BRACE", "GAE", "VTrace", "ValueTarget", "ValueTargets"]
