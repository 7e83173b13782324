"""A closed-loop learner on :class:`~brace_lightning.sim.mdp.CountingMDP` with exact ground truth.

Per version v the loop does what the asynchronous trainer does, on a problem where every value is
known exactly:

1. sample ``batch_size`` responses from µ = π_{v−S} (a queue of the last S + 1 policies, so the
   lag is exact), scoring them under the current π;
2. compute the value target with one of the project's estimators
   (:mod:`brace_lightning.targets`) from the *current* critic, and move the critic towards it
   with a fixed budget of ``critic_updates`` steps (tabular rate α, or Adam on a small MLP over
   the state features (t/T, c/K));
3. update the actor (tabular logits over the statistic (t, c)) with one of the project's actor
   objectives (:mod:`brace_lightning.objectives`) on the whitened advantages — so the policy's
   drift comes from learning on visited states;
4. optionally add engine/trainer drift to the *behavior* copy that enters the queue: Gaussian
   noise on every logit, or sparse heavy-tailed jumps (a few entries, Student-t sized) scaled
   to the same per-token KL.

Logged per version (:class:`VersionLog`): exact V^π(s₀), the critic's gap to V^π on π's exact
occupancy (ĝ_π) and to V^µ on µ's occupancy (ĝ_µ), the label bias b̂ = mean(label − V^π) and its
variance over sampled actions, the truncated log-product log Π_t min(c̄, w_t) per response,
and the actor objective's mask fractions.
"""

from __future__ import annotations

import collections
import math
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch

from brace_lightning.objectives.base import ActorObjective
from brace_lightning.sim.critic import ValueTargetFn
from brace_lightning.sim.mdp import (
    CountingMDP,
    Trajectories,
    exact_values,
    occupancy,
    sample,
    state_values,
)
from brace_lightning.sim.policies import per_token_kl, uniform_logits

__all__ = ["ClosedLoopConfig", "VersionLog", "run_closed_loop"]

Drift = Literal["none", "gaussian", "sparse"]
CriticKind = Literal["tabular", "mlp"]


@dataclass(frozen=True)
class ClosedLoopConfig:
    """Everything that defines one closed-loop run (together with the target and objective).

    Args:
        horizon: T, tokens per response.
        num_actions: A, vocabulary size.
        success: initial success probability of the uniform policy (sets the threshold K).
        versions: number of policy versions (actor updates).
        staleness: S ≥ 0; µ = π_{v−S} (the first S versions sample from π_0).
        batch_size: responses sampled per version.
        actor_lr: Adam learning rate on the tabular logits.
        critic: ``"tabular"`` or ``"mlp"``.
        critic_updates: critic steps per version (the fixed update budget).
        critic_lr: α of the tabular critic, in (0, 1]; Adam's rate for the MLP.
        critic_hidden: hidden width of the MLP critic.
        drift: ``"none"``, ``"gaussian"`` or ``"sparse"`` extra drift of µ from π.
        drift_kl: per-token KL(µ ‖ π) of the extra drift (both models are scaled to it).
        c_bar: c̄ used for the truncated log-product statistic.
        seed: fixes sampling, drift and the MLP's initialization.
    """

    horizon: int = 64
    num_actions: int = 4
    success: float = 0.1
    versions: int = 50
    staleness: int = 0
    batch_size: int = 32
    actor_lr: float = 0.1
    critic: CriticKind = "tabular"
    critic_updates: int = 1
    critic_lr: float = 0.5
    critic_hidden: int = 32
    drift: Drift = "none"
    drift_kl: float = 0.0
    c_bar: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("versions", self.versions >= 1, ">= 1"),
            ("staleness", self.staleness >= 0, ">= 0"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("critic_updates", self.critic_updates >= 0, ">= 0"),
            ("actor_lr", self.actor_lr >= 0.0, ">= 0"),
            ("critic_lr", self.critic_lr > 0.0, "> 0"),
            ("drift_kl", self.drift_kl >= 0.0, ">= 0"),
            ("c_bar", self.c_bar > 0.0, "> 0"),
            ("critic", self.critic in ("tabular", "mlp"), "'tabular' or 'mlp'"),
            ("drift", self.drift in ("none", "gaussian", "sparse"), "none/gaussian/sparse"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}; got {getattr(self, name)!r}.")
        if self.critic == "tabular" and not self.critic_lr <= 1.0:
            raise ValueError(
                f"critic_lr must be in (0, 1] for a tabular critic; got {self.critic_lr!r}."
            )


@dataclass
class VersionLog:
    """Per-version measurements (lists indexed by version)."""

    value_pi: list[float] = field(default_factory=list)
    gap_pi: list[float] = field(default_factory=list)
    gap_mu: list[float] = field(default_factory=list)
    label_bias: list[float] = field(default_factory=list)
    label_variance: list[float] = field(default_factory=list)
    log_product_mean: list[float] = field(default_factory=list)
    log_product_min: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    actor_stats: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _drift(
    mdp: CountingMDP, logits: torch.Tensor, kind: Drift, kl: float, generator: torch.Generator
) -> torch.Tensor:
    """µ's logits: π's plus a seeded direction scaled by bisection to per-token KL(µ ‖ π) = kl."""
    if kind == "none" or kl == 0.0:
        return logits
    if kind == "gaussian":
        direction = torch.randn(mdp.logits_shape, generator=generator, dtype=torch.float64)
    else:  # sparse, heavy-tailed: 1% of the entries get a Student-t(1.5) jump
        keep = torch.rand(mdp.logits_shape, generator=generator, dtype=torch.float64) < 0.01
        normal = torch.randn(mdp.logits_shape, generator=generator, dtype=torch.float64)
        chi = torch.distributions.Chi2(torch.tensor(1.5, dtype=torch.float64))
        scale = (chi.sample(mdp.logits_shape) / 1.5).sqrt()
        direction = keep * normal / scale
    # KL(µ ‖ π) per token weighted by π's occupancy (fixed across the bisection, so it stays cheap).
    weights = occupancy(mdp, logits) / mdp.horizon
    log_pi = torch.log_softmax(logits, dim=-1)

    def achieved(scale: float) -> float:
        log_mu = torch.log_softmax(logits + scale * direction, dim=-1)
        return float((weights * (log_mu.exp() * (log_mu - log_pi)).sum(-1)).sum())

    low, high = 0.0, 1.0
    while achieved(high) < kl and high < 1e4:
        low, high = high, 2.0 * high
    for _ in range(40):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if achieved(middle) < kl else (low, middle)
    return logits + 0.5 * (low + high) * direction


class _MLPCritic(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(2, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        ).double()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).squeeze(-1)


def _features(mdp: CountingMDP) -> torch.Tensor:
    """``[T, C, 2]`` float64 features (t/T, c/K) of every state."""
    t = torch.arange(mdp.horizon, dtype=torch.float64)[:, None] / mdp.horizon
    c = torch.arange(mdp.num_counts, dtype=torch.float64)[None, :] / mdp.threshold
    return torch.stack(torch.broadcast_tensors(t, c), dim=-1)


def _weighted_gap(table: torch.Tensor, truth: torch.Tensor, weights: torch.Tensor) -> float:
    """Occupancy-weighted mean |V̂ − V| over the T action positions."""
    return float((weights * (table[:-1] - truth[:-1]).abs()).sum() / weights.shape[0])


def run_closed_loop(
    config: ClosedLoopConfig, target: ValueTargetFn, objective: ActorObjective
) -> VersionLog:
    """Run the closed loop of the module docstring and return its per-version log.

    Args:
        config: the run's settings (:class:`ClosedLoopConfig`).
        target: the critic's value target, e.g. ``brace_lightning.targets.BRACE(k=100)``.
        objective: the actor objective, e.g. ``brace_lightning.objectives.PPOClip()``.

    Returns:
        :class:`VersionLog` with ``config.versions`` entries per field.
    """
    torch.manual_seed(config.seed)
    mdp = CountingMDP.calibrated(config.horizon, config.num_actions, success=config.success)
    generator = torch.Generator().manual_seed(config.seed)
    logits = uniform_logits(mdp).requires_grad_(True)
    actor_opt = torch.optim.Adam([logits], lr=config.actor_lr)
    queue: collections.deque[torch.Tensor] = collections.deque(maxlen=config.staleness + 1)

    features = _features(mdp)
    mlp = _MLPCritic(config.critic_hidden) if config.critic == "mlp" else None
    critic_opt = torch.optim.Adam(mlp.parameters(), lr=config.critic_lr) if mlp else None
    table = torch.zeros(mdp.horizon + 1, mdp.num_counts, dtype=torch.float64)
    positions = torch.arange(mdp.horizon)
    log = VersionLog()
    log_c_bar = math.log(config.c_bar)

    def critic_table() -> torch.Tensor:
        if mlp is None:
            return table
        with torch.no_grad():
            out = torch.zeros_like(table)
            out[:-1] = mlp(features)
            return out

    for _ in range(config.versions):
        pi = logits.detach().clone()
        queue.append(_drift(mdp, pi, config.drift, config.drift_kl, generator))
        mu = queue[0]
        batch = sample(mdp, mu, pi, batch_size=config.batch_size, generator=generator)
        mask = batch.mask
        flat = (positions * mdp.num_counts + batch.counts)[mask]
        visits = torch.bincount(flat, minlength=mdp.horizon * mdp.num_counts)
        visited = visits > 0

        def labels(
            batch: Trajectories = batch, mask: torch.Tensor = mask
        ) -> tuple[torch.Tensor, torch.Tensor]:
            values = state_values(critic_table(), batch.counts)
            out = target(
                rewards=batch.rewards,
                values=values,
                target_logprobs=batch.target_logprobs,
                behavior_logprobs=batch.behavior_logprobs,
                mask=mask,
            )
            return out.returns.to(torch.float64), out.advantages.to(torch.float64)

        # Advantages for the actor come from the critic before this version's critic steps,
        # as in a trainer that computes targets once per batch.
        returns, advantages = labels()
        truth_pi = exact_values(mdp, pi)
        error = returns[mask] - state_values(truth_pi, batch.counts)[mask]
        log.label_bias.append(float(error.mean()))
        log.label_variance.append(float(error.var(unbiased=False)))

        for step in range(config.critic_updates):
            step_returns = returns if step == 0 else labels()[0]
            if mlp is None:
                sums = torch.bincount(flat, weights=step_returns[mask], minlength=visits.numel())
                current = table[:-1].reshape(-1)
                current[visited] += config.critic_lr * (
                    sums[visited] / visits[visited] - current[visited]
                )
            else:
                assert critic_opt is not None
                predicted = mlp(features[positions.expand_as(batch.counts), batch.counts])
                loss = ((predicted - step_returns) ** 2)[mask].mean()
                critic_opt.zero_grad()
                loss.backward()
                critic_opt.step()

        # Actor step with the project's objective on whitened advantages.
        adv = advantages[mask]
        whitened = torch.zeros_like(advantages)
        whitened[mask] = (adv - adv.mean()) / (adv.std(unbiased=False) + 1e-8)
        log_pi = torch.log_softmax(logits, dim=-1)[positions.expand_as(batch.counts), batch.counts]
        taken = log_pi.gather(-1, batch.actions.unsqueeze(-1)).squeeze(-1)
        output = objective(
            logprobs=taken,
            proximal_logprobs=taken.detach(),
            behavior_logprobs=batch.behavior_logprobs,
            advantages=whitened,
            mask=mask,
        )
        actor_opt.zero_grad()
        (output.token_loss.sum() / mask.sum()).backward()
        actor_opt.step()
        actions = float(mask.sum())
        for key, value in output.stats.items():
            scale = actions if key.endswith(("_count", "_sum")) else 1.0
            log.actor_stats.setdefault(key, []).append(float(value) / scale)

        # Ground truth for this version's critic (after its updates) and policies.
        estimate = critic_table()
        truth_mu = exact_values(mdp, mu)
        log.value_pi.append(float(truth_pi[0, 0]))
        log.gap_pi.append(_weighted_gap(estimate, truth_pi, occupancy(mdp, pi)))
        log.gap_mu.append(_weighted_gap(estimate, truth_mu, occupancy(mdp, mu)))
        log_w = (batch.target_logprobs - batch.behavior_logprobs).clamp(max=log_c_bar)
        log_product = log_w.sum(dim=-1)
        log.log_product_mean.append(float(log_product.mean()))
        log.log_product_min.append(float(log_product.min()))
        log.kl.append(float(per_token_kl(mdp, mu, pi)))
        log.reward.append(float(batch.rewards[:, -1].mean()))
    return log
