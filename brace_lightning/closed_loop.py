"""A closed-loop learner on :class:`~brace_lightning.sim.mdp.CountingMDP` with exact ground truth.

Per version v the loop does what the asynchronous trainer does, on a problem where every value is
known exactly:

1. sample ``batch_size`` responses from µ = π_{v−S} (a queue of the last S + 1 policies, so the
   lag is exact), scoring them under the current π;
2. compute the value target with one of the project's estimators
   (:mod:`brace_lightning.targets`) from the *current* critic, and move the critic towards it
   with a fixed budget of ``critic_updates`` steps (tabular rate α, or Adam on a small MLP over
   the state features (t/T, c/K));
3. update the actor with one of the project's actor objectives (:mod:`brace_lightning.objectives`)
   on the whitened advantages — tabular logits over the statistic (t, c), whose drift stays on the
   visited states, or a small MLP over the state features, whose every step also moves the
   unvisited states (as an LM's shared weights do). As in the trainer, two options leave the actor
   still: during the first ``critic_warmup_versions`` versions (the critic warm-up), and, with
   ``skip_equal_reward_batches``, on a batch whose rewards are all equal (whitening would turn the
   critic's noise into a full actor step; :mod:`brace_lightning.equal_rewards`);
4. optionally add engine/trainer drift to the *behavior* copy that enters the queue: Gaussian
   noise on every logit, or sparse heavy-tailed jumps (a few entries, Student-t sized) scaled
   to the same per-token KL.

Logged per version (:class:`VersionLog`): exact V^π(s₀), the critic's gap to V^π on π's exact
occupancy (ĝ_π) and to V^µ on µ's occupancy (ĝ_µ), the label bias b̂ = mean(label − V^π) and its
variance over sampled actions, β by remaining horizon (:class:`~brace_lightning.metrics.HorizonBeta`:
the slope of the label on the realized return), the truncated log-product log Π_t min(c̄, w_t) per
response at ``c_bar`` (the BRACE default 1.1) and over windows of ``PRODUCT_WINDOW`` = 100 tokens
(Π_k at BRACE's k = 100), the realized per-token |log w| = |log π − log µ| (mean and quantiles, to
place a real run's mismatch on the drift axis), whether the actor stepped, and the actor
objective's mask fractions.

Cost: every policy's ``[T, C, A]`` log-softmax is computed once per version and shared by the
sampler, the exact dynamic programs and the KL; the drift's scale is solved on the states π visits
(occupancy > 1e-14) by a safeguarded s ← s·√(KL*/KL(s)) iteration (KL ≈ ½ s² Var_π(ξ) for small s)
to 0.1% of the requested KL. A 200-version T = 1024 run takes 43 s on one idle core (about a
minute on a busy one); T = 256 takes 0.07 s per version.

It lives above ``sim/`` (pure math) because it composes it with the estimators, the objectives and
the β metric (a torchmetrics ``Metric``), as the trainer composes the models.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal, NamedTuple

import torch

from brace_lightning.metrics.critic import HorizonBeta, power_of_two_edges
from brace_lightning.metrics.functional import reward_to_go
from brace_lightning.objectives.base import ActorObjective
from brace_lightning.sim.critic import ValueTargetFn
from brace_lightning.sim.mdp import (
    CountingMDP,
    Trajectories,
    occupancy_from_good_probability,
    sample_from_log_probs,
    state_values,
    values_from_good_probability,
)
from brace_lightning.sim.policies import per_token_kl_of_log_probs

__all__ = [
    "PRODUCT_WINDOW",
    "ClosedLoopConfig",
    "VersionLog",
    "log_weight_statistics",
    "run_closed_loop",
]

Drift = Literal["none", "gaussian", "sparse"]
ModelKind = Literal["tabular", "mlp"]

# States whose occupancy under π is below this carry no weight in the drift's KL (float64 round-off).
_SUPPORT = 1e-14

#: Tokens per window of the logged Π_k (BRACE's default cap k = 100).
PRODUCT_WINDOW = 100


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
        actor: ``"tabular"`` (logits per state (t, c)) or ``"mlp"`` (logits from the features
            (t/T, c/K) through one hidden layer; starts uniform).
        actor_lr: Adam's learning rate for the actor.
        actor_hidden: hidden width of the MLP actor.
        critic: ``"tabular"`` or ``"mlp"``.
        critic_updates: critic steps per version (the fixed update budget).
        critic_lr: α of the tabular critic, in (0, 1]; Adam's rate for the MLP.
        critic_hidden: hidden width of the MLP critic.
        drift: ``"none"``, ``"gaussian"`` or ``"sparse"`` extra drift of µ from π.
        drift_kl: per-token KL(µ ‖ π) of the extra drift (both models are scaled to it).
        critic_warmup_versions: versions at the start in which only the critic trains (the
            trainer's ``critic_warmup_steps``); the actor stays at π_0.
        skip_equal_reward_batches: no actor step on a batch whose rewards are all equal (the
            trainer's batch rule, ``BraceModule(skip_equal_reward_batches=True)``).
        c_bar: c̄ of the logged truncated log-products (statistics only; the default is BRACE's
            1.1 — before 2026-12-06 it was 1.0, the value behind results.md's "−23 to −30").
        seed: fixes sampling, drift and the MLPs' initialization.
    """

    horizon: int = 64
    num_actions: int = 4
    success: float = 0.1
    versions: int = 50
    staleness: int = 0
    batch_size: int = 32
    actor: ModelKind = "tabular"
    actor_lr: float = 0.1
    actor_hidden: int = 32
    critic: ModelKind = "tabular"
    critic_updates: int = 1
    critic_lr: float = 0.5
    critic_hidden: int = 32
    drift: Drift = "none"
    drift_kl: float = 0.0
    critic_warmup_versions: int = 0
    skip_equal_reward_batches: bool = False
    c_bar: float = 1.1
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("versions", self.versions >= 1, ">= 1"),
            ("staleness", self.staleness >= 0, ">= 0"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("critic_updates", self.critic_updates >= 0, ">= 0"),
            ("actor_lr", self.actor_lr >= 0.0, ">= 0"),
            ("actor_hidden", self.actor_hidden >= 1, ">= 1"),
            ("critic_lr", self.critic_lr > 0.0, "> 0"),
            ("critic_hidden", self.critic_hidden >= 1, ">= 1"),
            ("drift_kl", self.drift_kl >= 0.0, ">= 0"),
            ("critic_warmup_versions", self.critic_warmup_versions >= 0, ">= 0"),
            (
                "skip_equal_reward_batches",
                isinstance(self.skip_equal_reward_batches, bool),
                "a bool",
            ),
            ("c_bar", self.c_bar > 0.0, "> 0"),
            ("actor", self.actor in ("tabular", "mlp"), "'tabular' or 'mlp'"),
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
    """Per-version measurements (lists indexed by version).

    ``beta[v]`` holds β per remaining-horizon bin whose left edges are ``beta_edges`` (1, 2, 4, …),
    None where a bin is undefined (no spread in the return). ``log_product_*`` are log Π min(c̄, w)
    at the config's ``c_bar``: over a whole response (mean and min over the batch) and over every
    window of ``PRODUCT_WINDOW`` tokens (mean; the whole response when T is shorter).
    ``abs_log_w_*`` are the per-token |log π − log µ| statistics of :func:`log_weight_statistics`.
    ``actor_stepped`` is 1.0 where the actor took its step, 0.0 where it stood still.
    """

    value_pi: list[float] = field(default_factory=list)
    gap_pi: list[float] = field(default_factory=list)
    gap_mu: list[float] = field(default_factory=list)
    label_bias: list[float] = field(default_factory=list)
    label_variance: list[float] = field(default_factory=list)
    beta: list[list[float | None]] = field(default_factory=list)
    beta_edges: list[int] = field(default_factory=list)
    log_product_mean: list[float] = field(default_factory=list)
    log_product_min: list[float] = field(default_factory=list)
    log_product_window_mean: list[float] = field(default_factory=list)
    abs_log_w_mean: list[float] = field(default_factory=list)
    abs_log_w_p50: list[float] = field(default_factory=list)
    abs_log_w_p90: list[float] = field(default_factory=list)
    abs_log_w_p99: list[float] = field(default_factory=list)
    abs_log_w_max: list[float] = field(default_factory=list)
    actor_stepped: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    shadow_gap_pi: dict[str, list[float]] = field(default_factory=dict)
    actor_stats: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _drift(
    mdp: CountingMDP,
    logits: torch.Tensor,
    target_log_probs: torch.Tensor,
    weights: torch.Tensor,
    kind: Drift,
    kl: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """µ's logits: π's plus a seeded direction ξ scaled so that the KL(µ ‖ π) per token is ``kl``.

    The KL is weighted by ``weights`` (π's occupancy / T, fixed during the solve). ξ is drawn on
    the states with weight above ``_SUPPORT`` (π never reaches the others), only states with a
    non-zero ξ enter the KL, and the scale s is found by the safeguarded iteration s ← s·√(kl / KL(s)), exact when KL ∝ s², inside a bisection bracket.
    """
    if kind == "none" or kl == 0.0:
        return logits
    # ξ is drawn on π's support only (the rest carries no KL weight): same draws for a same seed.
    rows = weights > _SUPPORT
    shape = (int(rows.sum()), mdp.num_actions)
    if kind == "gaussian":
        xi = torch.randn(shape, generator=generator, dtype=torch.float64)
    else:  # sparse, heavy-tailed: 1% of the entries get a Student-t(1.5) jump
        keep = torch.rand(shape, generator=generator, dtype=torch.float64) < 0.01
        normal = torch.randn(shape, generator=generator, dtype=torch.float64)
        chi = torch.distributions.Chi2(torch.tensor(1.5, dtype=torch.float64))
        xi = keep * normal / (chi.sample(shape) / 1.5).sqrt()
    direction = torch.zeros(mdp.logits_shape, dtype=torch.float64)
    direction[rows] = xi
    moved = rows.clone()
    moved[rows] = (xi != 0).any(dim=-1)
    if not bool(moved.any()):
        return logits
    xi, base, log_pi, w = direction[moved], logits[moved], target_log_probs[moved], weights[moved]

    def achieved(scale: float) -> float:
        log_mu = torch.log_softmax(base + scale * xi, dim=-1)
        return float((w * (log_mu.exp() * (log_mu - log_pi)).sum(-1)).sum())

    # Second order: KL(s) ≈ ½ s² Σ w Var_π(ξ), the starting point of the iteration.
    pi = log_pi.exp()
    variance = (pi * xi**2).sum(-1) - (pi * xi).sum(-1) ** 2
    curvature = 0.5 * float((w * variance).sum())
    if curvature <= 0.0:
        return logits
    low, high = 0.0, math.inf
    scale = math.sqrt(kl / curvature)
    for _ in range(100):
        value = achieved(scale)
        if abs(value - kl) <= 1e-3 * kl:
            break
        low, high = (scale, high) if value < kl else (low, scale)
        guess = scale * math.sqrt(kl / value) if value > 0.0 else 2.0 * scale
        scale = (
            guess if low < guess < high else (0.5 * (low + high) if high < math.inf else 2 * low)
        )
    return logits + scale * direction


def log_weight_statistics(
    log_w: torch.Tensor, mask: torch.Tensor, *, c_bar: float, window: int = PRODUCT_WINDOW
) -> dict[str, float]:
    """The realized importance-weight statistics of a batch, to place a run on the drift axis.

    Args:
        log_w: ``[B, T]`` per-token log π − log µ of the sampled actions.
        mask: ``[B, T]`` bool, True at actions.
        c_bar: the truncation level c̄ of the products.
        window: k, tokens per window of the windowed product Π_k.

    Returns:
        ``abs_mean``, ``abs_p50``, ``abs_p90``, ``abs_p99`` and ``abs_max`` of |log w| over actions;
        ``product_mean`` and ``product_min`` of the whole response's Σ_t min(log c̄, log w_t) over
        rows; ``window_mean``, the mean over every window of ``window`` consecutive tokens of that
        sum (positions outside ``mask`` count 0; the whole row when T < ``window``).
    """
    clipped = torch.where(mask, log_w.clamp(max=math.log(c_bar)), 0.0)
    magnitude = log_w[mask].abs().double()
    quantiles = torch.quantile(magnitude, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    product = clipped.sum(dim=-1)
    width = min(window, clipped.shape[-1])
    windows = clipped.unfold(-1, width, 1).sum(dim=-1)  # [B, T - width + 1]
    return {
        "abs_mean": float(magnitude.mean()),
        "abs_p50": float(quantiles[0]),
        "abs_p90": float(quantiles[1]),
        "abs_p99": float(quantiles[2]),
        "abs_max": float(magnitude.max()),
        "product_mean": float(product.mean()),
        "product_min": float(product.min()),
        "window_mean": float(windows.mean()),
    }


class _MLP(torch.nn.Module):
    """Features ``[..., 2]`` → ``[..., out]`` through one tanh layer (float64)."""

    def __init__(self, hidden: int, out: int, *, zero_output: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(2, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, out)
        ).double()
        if zero_output:  # starts as the constant 0: uniform logits
            torch.nn.init.zeros_(self.net[2].weight)
            torch.nn.init.zeros_(self.net[2].bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


def _features(mdp: CountingMDP) -> torch.Tensor:
    """``[T, C, 2]`` float64 features (t/T, c/K) of every state."""
    t = torch.arange(mdp.horizon, dtype=torch.float64)[:, None] / mdp.horizon
    c = torch.arange(mdp.num_counts, dtype=torch.float64)[None, :] / mdp.threshold
    return torch.stack(torch.broadcast_tensors(t, c), dim=-1)


class _Actor:
    """The trained policy: a logit table (tabular) or an MLP over the state features."""

    def __init__(self, config: ClosedLoopConfig, mdp: CountingMDP) -> None:
        self.features = _features(mdp)
        self.mlp: _MLP | None = None
        if config.actor == "mlp":
            self.mlp = _MLP(config.actor_hidden, mdp.num_actions, zero_output=True)
            params = list(self.mlp.parameters())
        else:
            self.logits = torch.zeros(mdp.logits_shape, dtype=torch.float64, requires_grad=True)
            params = [self.logits]
        self.optimizer = torch.optim.Adam(params, lr=config.actor_lr)

    def table(self) -> torch.Tensor:
        """``[T, C, A]`` logits of every state, detached."""
        if self.mlp is None:
            return self.logits.detach().clone()
        with torch.no_grad():
            return self.mlp(self.features)

    def log_probs(self, positions: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``[B, T, A]`` log π at the sampled states, differentiable."""
        if self.mlp is None:
            return torch.log_softmax(self.logits[positions, counts], dim=-1)
        return torch.log_softmax(self.mlp(self.features[positions, counts]), dim=-1)


class _Policy(NamedTuple):
    """A policy's ``[T, C, A]`` log-probabilities with its exact ``[T, C]`` occupancy and values."""

    log_probs: torch.Tensor
    occupancy: torch.Tensor
    values: torch.Tensor

    @classmethod
    def of(cls, mdp: CountingMDP, log_probs: torch.Tensor) -> _Policy:
        good = log_probs[..., 0].exp()
        return cls(
            log_probs,
            occupancy_from_good_probability(mdp, good),
            values_from_good_probability(mdp, good),
        )


def _weighted_gap(table: torch.Tensor, truth: torch.Tensor, weights: torch.Tensor) -> float:
    """Occupancy-weighted mean |V̂ − V| over the T action positions."""
    return float((weights * (table[:-1] - truth[:-1]).abs()).sum() / weights.shape[0])


class _Critic:
    """A learned critic with a fixed update budget per version: a table (rate α) or an MLP (Adam).

    ``labels`` computes the value target from the critic as it is now, exactly as the trainer
    does; ``update`` takes ``critic_updates`` steps, recomputing the labels after the first.
    """

    def __init__(self, config: ClosedLoopConfig, mdp: CountingMDP, features: torch.Tensor) -> None:
        self.config, self.mdp, self.features = config, mdp, features
        self.values = torch.zeros(mdp.horizon + 1, mdp.num_counts, dtype=torch.float64)
        self.mlp: _MLP | None = None
        if config.critic == "mlp":
            self.mlp = _MLP(config.critic_hidden, 1, zero_output=False)
            self.optimizer = torch.optim.Adam(self.mlp.parameters(), lr=config.critic_lr)

    def table(self) -> torch.Tensor:
        """``[T + 1, C]`` values of every state (row T is 0)."""
        if self.mlp is None:
            return self.values
        with torch.no_grad():
            out = torch.zeros_like(self.values)
            out[:-1] = self.mlp(self.features).squeeze(-1)
            return out

    def labels(
        self, target: ValueTargetFn, batch: Trajectories
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` float64 value targets and advantages from the current critic."""
        out = target(
            rewards=batch.rewards,
            values=state_values(self.table(), batch.counts),
            target_logprobs=batch.target_logprobs,
            behavior_logprobs=batch.behavior_logprobs,
            mask=batch.mask,
        )
        return out.returns.to(torch.float64), out.advantages.to(torch.float64)

    def update(self, target: ValueTargetFn, batch: Trajectories, returns: torch.Tensor) -> None:
        """The version's budget of steps; ``returns`` are the labels for the first one."""
        mask = batch.mask
        positions = torch.arange(self.mdp.horizon).expand_as(batch.counts)
        flat = (positions * self.mdp.num_counts + batch.counts)[mask]
        visits = torch.bincount(flat, minlength=self.mdp.horizon * self.mdp.num_counts)
        visited = visits > 0
        for step in range(self.config.critic_updates):
            step_returns = returns if step == 0 else self.labels(target, batch)[0]
            if self.mlp is None:
                sums = torch.bincount(flat, weights=step_returns[mask], minlength=visits.numel())
                current = self.values[:-1].reshape(-1)
                current[visited] += self.config.critic_lr * (
                    sums[visited] / visits[visited] - current[visited]
                )
            else:
                predicted = self.mlp(self.features[positions, batch.counts]).squeeze(-1)
                loss = ((predicted - step_returns) ** 2)[mask].mean()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()


def run_closed_loop(
    config: ClosedLoopConfig,
    target: ValueTargetFn,
    objective: ActorObjective,
    *,
    shadow_targets: Mapping[str, ValueTargetFn] | None = None,
) -> VersionLog:
    """Run the closed loop of the module docstring and return its per-version log.

    Args:
        config: the run's settings (:class:`ClosedLoopConfig`).
        target: the critic's value target, e.g. ``brace_lightning.targets.BRACE(k=100)``; its
            advantages drive the actor.
        objective: the actor objective, e.g. ``brace_lightning.objectives.PPOClip()``.
        shadow_targets: name → value target of extra critics (same kind, rate and budget) trained
            on the same batches but never used by the actor, so every target is compared on one
            actor trajectory and one data stream: ``VersionLog.shadow_gap_pi[name]``.

    Returns:
        :class:`VersionLog` with ``config.versions`` entries per field.
    """
    torch.manual_seed(config.seed)
    mdp = CountingMDP.calibrated(config.horizon, config.num_actions, success=config.success)
    generator = torch.Generator().manual_seed(config.seed)
    actor = _Actor(config, mdp)
    # The behavior policies of the last S + 1 versions.
    queue: collections.deque[_Policy] = collections.deque(maxlen=config.staleness + 1)
    critic = _Critic(config, mdp, actor.features)
    shadows = {
        name: (shadow_target, _Critic(config, mdp, actor.features))
        for name, shadow_target in (shadow_targets or {}).items()
    }
    positions = torch.arange(mdp.horizon)
    edges = power_of_two_edges(mdp.horizon, start=1)
    log = VersionLog(beta_edges=list(edges), shadow_gap_pi={name: [] for name in shadows})

    for version in range(config.versions):
        pi = actor.table()
        target_policy = _Policy.of(mdp, torch.log_softmax(pi, dim=-1))
        behavior = _drift(
            mdp,
            pi,
            target_policy.log_probs,
            target_policy.occupancy / mdp.horizon,
            config.drift,
            config.drift_kl,
            generator,
        )
        queue.append(
            target_policy
            if behavior is pi
            else _Policy.of(mdp, torch.log_softmax(behavior, dim=-1))
        )
        behavior_policy = queue[0]
        batch = sample_from_log_probs(
            mdp,
            behavior_policy.log_probs,
            target_policy.log_probs,
            batch_size=config.batch_size,
            generator=generator,
        )
        mask = batch.mask

        # Advantages for the actor come from the critic before this version's critic steps,
        # as in a trainer that computes targets once per batch.
        returns, advantages = critic.labels(target, batch)
        error = returns[mask] - state_values(target_policy.values, batch.counts)[mask]
        log.label_bias.append(float(error.mean()))
        log.label_variance.append(float(error.var(unbiased=False)))
        beta = HorizonBeta(edges)
        beta.update(returns, reward_to_go(batch.rewards, mask), mask)
        binned = beta.compute()
        log.beta.append(
            [
                v if ok else None
                for v, ok in zip(binned.value.tolist(), binned.defined.tolist(), strict=True)
            ]
        )
        critic.update(target, batch, returns)
        for name, (shadow_target, shadow) in shadows.items():
            shadow.update(shadow_target, batch, shadow.labels(shadow_target, batch)[0])
            gap = _weighted_gap(shadow.table(), target_policy.values, target_policy.occupancy)
            log.shadow_gap_pi[name].append(gap)

        # Actor step with the project's objective on whitened advantages.
        adv = advantages[mask]
        whitened = torch.zeros_like(advantages)
        whitened[mask] = (adv - adv.mean()) / (adv.std(unbiased=False) + 1e-8)
        log_pi = actor.log_probs(positions.expand_as(batch.counts), batch.counts)
        taken = log_pi.gather(-1, batch.actions.unsqueeze(-1)).squeeze(-1)
        output = objective(
            logprobs=taken,
            proximal_logprobs=taken.detach(),
            behavior_logprobs=batch.behavior_logprobs,
            advantages=whitened,
            mask=mask,
        )
        rewards = batch.rewards[:, -1]
        still = version < config.critic_warmup_versions or (
            config.skip_equal_reward_batches and bool((rewards == rewards[0]).all())
        )
        actor.optimizer.zero_grad()
        (output.token_loss.sum() / mask.sum()).backward()
        if not still:
            actor.optimizer.step()
        log.actor_stepped.append(0.0 if still else 1.0)
        actions = float(mask.sum())
        for key, value in output.stats.items():
            scale = actions if key.endswith(("_count", "_sum")) else 1.0
            log.actor_stats.setdefault(key, []).append(float(value) / scale)

        # Ground truth for this version's critic (after its updates) and policies.
        estimate = critic.table()
        log.value_pi.append(float(target_policy.values[0, 0]))
        log.gap_pi.append(_weighted_gap(estimate, target_policy.values, target_policy.occupancy))
        log.gap_mu.append(
            _weighted_gap(estimate, behavior_policy.values, behavior_policy.occupancy)
        )
        weights = log_weight_statistics(
            batch.target_logprobs - batch.behavior_logprobs, mask, c_bar=config.c_bar
        )
        log.log_product_mean.append(weights.pop("product_mean"))
        log.log_product_min.append(weights.pop("product_min"))
        log.log_product_window_mean.append(weights.pop("window_mean"))
        for key, value in weights.items():  # abs_mean -> abs_log_w_mean, ...
            getattr(log, key.replace("abs_", "abs_log_w_")).append(value)
        kl = per_token_kl_of_log_probs(
            behavior_policy.log_probs, target_policy.log_probs, behavior_policy.occupancy
        )
        log.kl.append(float(kl))
        log.reward.append(float(batch.rewards[:, -1].mean()))
    return log
