"""An exactly solvable token-level MDP: deterministic transitions, terminal verifier reward.

The model of generation in the BRACE paper (§3.1): a response is T tokens from a vocabulary of A;
the state before token t is the prefix, transitions are deterministic (append the token), and the
only reward is the verifier's R on the last token. What is simplified here, and why: the verifier
only looks at how many times the *good* token (action 0) occurs, so the pair (t, c) — position and
running count of good tokens — is a sufficient statistic of the prefix, and every value function
is a ``[T + 1, C]`` table computed exactly by backward dynamic programming in O(T·C) memory.

    R(y) = 1[c_T ≥ K],    c_{t+1} = min(c_t + 1[a_t = 0], K),    C = K + 1 counts.

The count saturates at the threshold K (every state with c = K has already earned R = 1), which
keeps C small for long horizons. A policy is a logit table ``[T, C, A]`` over the statistic.

Conventions follow the trainer (``docs/conventions.md``): every column of a sampled row is an action,
the reward sits on the last action, and the value after the last action is 0 — so row T of a value
table is 0 and the reward is paid by the transition out of t = T − 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "CountingMDP",
    "Trajectories",
    "action_values",
    "exact_values",
    "occupancy",
    "occupancy_from_good_probability",
    "sample",
    "sample_from_log_probs",
    "state_values",
    "values_from_good_probability",
]


@dataclass(frozen=True)
class CountingMDP:
    """Token-level MDP whose verifier rewards reaching ``threshold`` good tokens in ``horizon``.

    Args:
        horizon: T, the number of tokens (actions) in every response, ≥ 1.
        num_actions: A, the vocabulary size, ≥ 2. Action 0 is the good token.
        threshold: K, good tokens needed for R = 1, in [1, horizon].
    """

    horizon: int
    num_actions: int
    threshold: int

    def __post_init__(self) -> None:
        if not isinstance(self.horizon, int) or self.horizon < 1:
            raise ValueError(f"horizon must be an int >= 1; got {self.horizon!r}.")
        if not isinstance(self.num_actions, int) or self.num_actions < 2:
            raise ValueError(f"num_actions must be an int >= 2; got {self.num_actions!r}.")
        if not isinstance(self.threshold, int) or not 1 <= self.threshold <= self.horizon:
            raise ValueError(
                f"threshold must be an int in [1, horizon={self.horizon}]; got {self.threshold!r}."
            )

    @classmethod
    def calibrated(cls, horizon: int, num_actions: int, *, success: float) -> CountingMDP:
        """The MDP whose threshold makes the uniform policy succeed with probability ≈ ``success``.

        K is the smallest count with P(Binomial(T, 1/A) ≥ K) ≤ ``success``, so MDPs of different
        horizons start equally hard and one step size of :func:`~brace_lightning.sim.policies.
        natural_gradient_step` makes similar progress on each.

        Args:
            horizon: T ≥ 1.
            num_actions: A ≥ 2.
            success: target initial success probability, in (0, 1).
        """
        if not 0.0 < success < 1.0:
            raise ValueError(f"success must be in (0, 1); got {success!r}.")
        if not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"horizon must be an int >= 1; got {horizon!r}.")
        if not isinstance(num_actions, int) or num_actions < 2:
            raise ValueError(f"num_actions must be an int >= 2; got {num_actions!r}.")
        counts = torch.arange(horizon + 1, dtype=torch.float64)
        binomial = torch.distributions.Binomial(horizon, probs=torch.tensor(1.0 / num_actions))
        pmf = binomial.log_prob(counts).exp()
        tail = pmf.flip(0).cumsum(0).flip(0)  # tail[K] = P(count ≥ K)
        threshold = int(torch.nonzero(tail <= success)[0]) if bool((tail <= success).any()) else 0
        return cls(horizon, num_actions, min(max(threshold, 1), horizon))

    @property
    def num_counts(self) -> int:
        """C = K + 1: the count statistic takes values 0..K (K absorbs every larger count)."""
        return self.threshold + 1

    @property
    def logits_shape(self) -> tuple[int, int, int]:
        """``(T, C, A)``, the shape of a policy's logit table."""
        return (self.horizon, self.num_counts, self.num_actions)

    def terminal_reward(self) -> torch.Tensor:
        """``[C]`` float64: R as a function of the final count, 1[c ≥ K]."""
        return (torch.arange(self.num_counts) >= self.threshold).to(torch.float64)

    def next_count(self, counts: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """c' = min(c + 1[a = 0], K), elementwise over long tensors of the same shape."""
        return torch.clamp(counts + (actions == 0).long(), max=self.threshold)

    def check_logits(self, name: str, logits: torch.Tensor) -> None:
        """Raise ValueError unless ``logits`` is a finite floating tensor of shape ``(T, C, A)``."""
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor; got {type(logits)}.")
        if tuple(logits.shape) != self.logits_shape:
            raise ValueError(
                f"{name} has shape {tuple(logits.shape)}; expected (T, C, A) = {self.logits_shape}."
            )
        if not bool(torch.isfinite(logits).all()):
            raise ValueError(f"{name} has non-finite entries; expected finite logits.")


def _good_probability(mdp: CountingMDP, name: str, logits: torch.Tensor) -> torch.Tensor:
    mdp.check_logits(name, logits)
    return torch.softmax(logits.to(torch.float64), dim=-1)[..., 0]


def _up_index(mdp: CountingMDP) -> torch.Tensor:
    """``[C]`` long: the count after a good token from each count."""
    return torch.clamp(torch.arange(mdp.num_counts) + 1, max=mdp.threshold)


def exact_values(mdp: CountingMDP, logits: torch.Tensor) -> torch.Tensor:
    """Exact state values V^π by backward dynamic programming.

    V(T − 1, c) = p_0 R(c⁺) + (1 − p_0) R(c),  V(t, c) = p_0 V(t + 1, c⁺) + (1 − p_0) V(t + 1, c),
    with p_0 = π(good | t, c) and c⁺ = min(c + 1, K); only the good token's probability matters
    because every other token leads to the same next state.

    Args:
        mdp: the MDP.
        logits: ``[T, C, A]`` policy logits.

    Returns:
        ``[T + 1, C]`` float64; row t < T is the value before action t, row T is 0 (terminal).
        Entries at counts unreachable at position t are still the well-defined value of that state.
    """
    return values_from_good_probability(mdp, _good_probability(mdp, "logits", logits))


def values_from_good_probability(mdp: CountingMDP, good_probability: torch.Tensor) -> torch.Tensor:
    """:func:`exact_values` from the ``[T, C]`` float64 table of π(good | t, c) (no checks).

    For loops that already hold a policy's probabilities (the closed-loop simulator), so the
    ``[T, C, A]`` softmax is computed once per policy.
    """
    up = _up_index(mdp)
    values = torch.zeros(mdp.horizon + 1, mdp.num_counts, dtype=torch.float64)
    after = mdp.terminal_reward()  # value of the state after the action, reward included
    for t in range(mdp.horizon - 1, -1, -1):
        after = good_probability[t] * after[up] + (1.0 - good_probability[t]) * after
        values[t] = after
    return values


def action_values(mdp: CountingMDP, values: torch.Tensor) -> torch.Tensor:
    """Action values Q(t, c, a) = r + V(t + 1, c') from a value table (deterministic transitions).

    Args:
        mdp: the MDP.
        values: ``[T + 1, C]`` state values (e.g. from :func:`exact_values`).

    Returns:
        ``[T, C, A]`` float64; Q(T − 1, c, a) = R(c'), the terminal reward.
    """
    shape = (mdp.horizon + 1, mdp.num_counts)
    if tuple(values.shape) != shape:
        raise ValueError(f"values has shape {tuple(values.shape)}; expected (T + 1, C) = {shape}.")
    after = values.to(torch.float64).clone()
    after[mdp.horizon] = mdp.terminal_reward()
    good = after[1:, _up_index(mdp)]  # [T, C]
    other = after[1:]  # [T, C]
    rest = other.unsqueeze(-1).expand(-1, -1, mdp.num_actions - 1)
    return torch.cat([good.unsqueeze(-1), rest], dim=-1)


def occupancy(mdp: CountingMDP, logits: torch.Tensor) -> torch.Tensor:
    """State-visitation probabilities d(t, c) = P(c_t = c) when sampling from ``logits``.

    Args:
        mdp: the MDP.
        logits: ``[T, C, A]`` policy logits.

    Returns:
        ``[T, C]`` float64, each row sums to 1 (every response starts at c = 0).
    """
    return occupancy_from_good_probability(mdp, _good_probability(mdp, "logits", logits))


def occupancy_from_good_probability(
    mdp: CountingMDP, good_probability: torch.Tensor
) -> torch.Tensor:
    """:func:`occupancy` from the ``[T, C]`` float64 table of π(good | t, c) (no checks)."""
    dist = torch.zeros(mdp.horizon, mdp.num_counts, dtype=torch.float64)
    current = torch.zeros(mdp.num_counts, dtype=torch.float64)
    current[0] = 1.0
    for t in range(mdp.horizon):
        dist[t] = current
        moved = current * good_probability[t]
        current = current - moved
        current[1:] += moved[:-1]
        current[-1] += moved[-1]  # the saturated count stays at K
    return dist


class Trajectories(NamedTuple):
    """Responses sampled from a behavior policy µ, as the trainer sees them, all ``[B, T]``.

    Attributes:
        rewards: float64, R on the last column, 0 elsewhere.
        mask: bool, all True (every column is an action).
        target_logprobs: float64, log π of the taken tokens.
        behavior_logprobs: float64, log µ of the taken tokens.
        actions: long, the sampled tokens.
        counts: long, the statistic c_t of the state *before* action t (so the state is (t, c_t)).
    """

    rewards: torch.Tensor
    mask: torch.Tensor
    target_logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    actions: torch.Tensor
    counts: torch.Tensor


def sample(
    mdp: CountingMDP,
    behavior_logits: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    batch_size: int,
    generator: torch.Generator | None = None,
) -> Trajectories:
    """Sample ``batch_size`` responses from µ and record log µ and log π of every token.

    Args:
        mdp: the MDP.
        behavior_logits: ``[T, C, A]`` logits of µ, the policy that samples.
        target_logits: ``[T, C, A]`` logits of π, the policy being trained (only scored).
        batch_size: B ≥ 1.
        generator: torch random generator (CPU) for reproducible draws.

    Returns:
        :class:`Trajectories` with ``[B, T]`` tensors.
    """
    mdp.check_logits("behavior_logits", behavior_logits)
    mdp.check_logits("target_logits", target_logits)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1; got {batch_size!r}.")
    return sample_from_log_probs(
        mdp,
        torch.log_softmax(behavior_logits.to(torch.float64), dim=-1),
        torch.log_softmax(target_logits.to(torch.float64), dim=-1),
        batch_size=batch_size,
        generator=generator,
    )


def sample_from_log_probs(
    mdp: CountingMDP,
    behavior_log_probs: torch.Tensor,
    target_log_probs: torch.Tensor,
    *,
    batch_size: int,
    generator: torch.Generator | None = None,
) -> Trajectories:
    """:func:`sample` from ``[T, C, A]`` float64 log-probabilities of µ and π (no checks).

    For loops that already hold both policies' log-softmax tables (the closed-loop simulator).
    """
    log_mu, log_pi = behavior_log_probs, target_log_probs
    # Inverse-CDF sampling; the last boundary is dropped so rounding can never exceed A − 1.
    cdf = log_mu.exp().cumsum(dim=-1)[..., :-1]
    shape = (batch_size, mdp.horizon)
    uniform = torch.rand(shape, generator=generator, dtype=torch.float64)
    actions = torch.empty(shape, dtype=torch.long)
    counts = torch.empty(shape, dtype=torch.long)
    count = torch.zeros(batch_size, dtype=torch.long)
    for t in range(mdp.horizon):
        counts[:, t] = count
        action = (uniform[:, t, None] > cdf[t, count]).sum(dim=-1)
        actions[:, t] = action
        count = mdp.next_count(count, action)
    positions = torch.arange(mdp.horizon).expand(shape)
    rewards = torch.zeros(shape, dtype=torch.float64)
    rewards[:, -1] = mdp.terminal_reward()[count]
    return Trajectories(
        rewards=rewards,
        mask=torch.ones(shape, dtype=torch.bool),
        target_logprobs=log_pi[positions, counts, actions],
        behavior_logprobs=log_mu[positions, counts, actions],
        actions=actions,
        counts=counts,
    )


def state_values(table: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Look a ``[T + 1, C]`` (or ``[T, C]``) table up at sampled states: ``out[b, t] = table[t, c_bt]``.

    Args:
        table: values over the statistic, at least T rows.
        counts: ``[B, T]`` long, the statistic before each action (``Trajectories.counts``).

    Returns:
        ``[B, T]`` in the table's dtype.
    """
    horizon = counts.shape[1]
    if table.dim() != 2 or table.shape[0] < horizon:
        raise ValueError(
            f"table has shape {tuple(table.shape)}; expected [T (+1), C] with T >= {horizon}."
        )
    return table[torch.arange(horizon).expand_as(counts), counts]
