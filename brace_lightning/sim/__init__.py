"""Exact token-level MDP with ground-truth V^π and V^µ, for critic-bias diagnostics and tutorials.

Pure math (torch only): :mod:`~brace_lightning.sim.mdp` (the MDP, exact dynamic programming,
sampling), :mod:`~brace_lightning.sim.policies` (learning sequences, stale and perturbed behavior
policies), :mod:`~brace_lightning.sim.critic` (a tabular critic fitted to any value target).
The closed-loop learner that trains an actor and critics on this MDP with the project's estimators,
objectives and metrics sits above them: :mod:`brace_lightning.closed_loop`.
"""

from brace_lightning.sim.critic import CriticFit, ValueTargetFn, fit_critic
from brace_lightning.sim.mdp import (
    CountingMDP,
    Trajectories,
    action_values,
    exact_values,
    occupancy,
    sample,
    state_values,
)
from brace_lightning.sim.policies import (
    StalePair,
    natural_gradient_step,
    per_token_kl,
    perturb,
    stale_pair,
    uniform_logits,
)

__all__ = [
    "CountingMDP",
    "CriticFit",
    "StalePair",
    "Trajectories",
    "ValueTargetFn",
    "action_values",
    "exact_values",
    "fit_critic",
    "natural_gradient_step",
    "occupancy",
    "per_token_kl",
    "perturb",
    "sample",
    "stale_pair",
    "state_values",
    "uniform_logits",
]
