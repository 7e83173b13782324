"""Config classes for the value targets: they carry and validate hyperparameters, then call a kernel.

Critic-based: ``GAE``, ``VTrace``, ``BRACE`` (kernels in ``functional``); critic-free, group-relative:
``GRPO``, ``DrGRPO``, ``RLOO`` (kernel in ``groups``; ``needs_critic`` is False, so the module builds
no critic).

Selected in YAML by LightningCLI ``class_path`` (``configs/targets/*.yaml``)::

    model:
      value_target:
        class_path: brace_lightning.targets.BRACE
        init_args: {k: 100, rho_bar: 1.2, c_bar: 1.1}
"""

from __future__ import annotations

import math

import torch

from brace_lightning.checks import require_bool
from brace_lightning.targets import functional as F
from brace_lightning.targets import groups
from brace_lightning.targets.functional import ValueTargets


class ValueTarget:
    """Base class: the critic's regression target and the actor's advantage from a rollout batch.

    Subclasses validate their hyperparameters in ``__init__`` (ValueError naming the argument) and
    compute in ``__call__`` by calling one kernel of :mod:`brace_lightning.targets.functional`.
    """

    #: Whether the estimator reads the importance weights π/µ (GAE does not).
    uses_importance_weights: bool = True

    #: Discount per action step; subclasses set it in ``__init__`` (β's realized return uses it).
    gamma: float = 1.0

    #: Whether the estimator reads each row's squared score-gradient norm (``score_sq_norms``,
    #: one backward per row; only the group-relative targets' ``optimal_baseline`` does).
    needs_score_norms: bool = False

    #: Which norm the trainer passes as ``score_sq_norms``: ``"parameters"`` (‖∇_θ log π_θ(y)‖²,
    #: exact) or ``"logits"`` (its forward-only proxy, the norm with respect to the logits).
    score_norm: str = "parameters"

    def __call__(
        self,
        *,
        rewards: torch.Tensor,
        values: torch.Tensor,
        target_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        mask: torch.Tensor,
        group_ids: torch.Tensor | None = None,
        score_sq_norms: torch.Tensor | None = None,
    ) -> ValueTargets:
        """All inputs ``[B, T]`` but ``group_ids`` ``[B]`` (int64, rows of one prompt share an id;
        read by the group-relative targets only) and ``score_sq_norms`` ``[B]`` (‖∇_θ log π_θ(y)‖²
        per row, given when ``needs_score_norms``); see :mod:`brace_lightning.targets.functional`
        for conventions."""
        raise NotImplementedError

    @property
    def needs_critic(self) -> bool:
        """Whether the target reads a critic's values (False: no critic is built or trained)."""
        return True

    def hparams(self) -> dict[str, object]:
        """The hyperparameters, for logging and ``repr``."""
        return dict(vars(self))

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.hparams().items())
        return f"{type(self).__name__}({args})"


class GAE(ValueTarget):
    """PPO's λ-return: the uncorrected target every peer uses (learns V^µ on stale data)."""

    def __init__(
        self,
        *,
        gamma: float = 1.0,
        lmbda: float = 1.0,
        rho_in_advantage: bool = False,
        rho_bar: float = 1.0,
    ) -> None:
        """
        Args:
            gamma: discount per action step, in [0, 1].
            lmbda: GAE λ, in [0, 1]; 1 regresses the Monte-Carlo return.
            rho_in_advantage: scale the actor's advantage by ρ_s = min(ρ̄, π/µ) as V-trace does
                (default False: PPO's GAE); the critic's target never changes.
            rho_bar: the truncation ρ̄ of that factor, a positive finite number (read only with
                ``rho_in_advantage``).
        """
        F.check_discount("gamma", gamma)
        F.check_discount("lmbda", lmbda)
        require_bool("rho_in_advantage", rho_in_advantage)
        F.check_truncation(rho_bar, rho_bar)
        self.gamma = gamma
        self.lmbda = lmbda
        self.rho_in_advantage = rho_in_advantage
        self.rho_bar = rho_bar

    @property
    def uses_importance_weights(self) -> bool:  # type: ignore[override]
        """GAE reads π/µ only for the ρ factor of its advantage."""
        return self.rho_in_advantage

    def __call__(
        self,
        *,
        rewards: torch.Tensor,
        values: torch.Tensor,
        target_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        mask: torch.Tensor,
        group_ids: torch.Tensor | None = None,
        score_sq_norms: torch.Tensor | None = None,
    ) -> ValueTargets:
        out = F.gae(rewards, values, mask, gamma=self.gamma, lmbda=self.lmbda)
        if not self.rho_in_advantage:
            return out
        advantages = F.rho_scaled(
            out.advantages, target_logprobs, behavior_logprobs, mask, rho_bar=self.rho_bar
        )
        return ValueTargets(advantages, out.returns)


class VTrace(ValueTarget):
    """IMPALA's V-trace target with λ (uncapped importance-weight products)."""

    def __init__(
        self,
        *,
        gamma: float = 1.0,
        lmbda: float = 1.0,
        rho_bar: float = 1.0,
        c_bar: float = 1.0,
        rho_in_advantage: bool = True,
    ) -> None:
        """
        Args:
            gamma: discount per action step, in [0, 1].
            lmbda: trace λ, in [0, 1] (c_i = λ·min(c̄, w_i)).
            rho_bar: truncation ρ̄ of the per-residual weight ρ_t = min(ρ̄, π/µ), > 0.
            c_bar: truncation c̄ of the trace weights, 0 < c̄ ≤ ρ̄.
            rho_in_advantage: the actor's advantage is ρ_s (r_s + γ v_{s+1} − V_s), IMPALA's
                (default); False drops ρ_s, leaving the actor-side correction to the objective.
        """
        F.check_discount("gamma", gamma)
        F.check_discount("lmbda", lmbda)
        F.check_truncation(rho_bar, c_bar)
        require_bool("rho_in_advantage", rho_in_advantage)
        self.gamma = gamma
        self.lmbda = lmbda
        self.rho_bar = rho_bar
        self.c_bar = c_bar
        self.rho_in_advantage = rho_in_advantage

    def __call__(
        self,
        *,
        rewards: torch.Tensor,
        values: torch.Tensor,
        target_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        mask: torch.Tensor,
        group_ids: torch.Tensor | None = None,
        score_sq_norms: torch.Tensor | None = None,
    ) -> ValueTargets:
        return F.vtrace(
            rewards,
            values,
            target_logprobs,
            behavior_logprobs,
            mask,
            gamma=self.gamma,
            lmbda=self.lmbda,
            rho_bar=self.rho_bar,
            c_bar=self.c_bar,
            rho_in_advantage=self.rho_in_advantage,
        )


class BRACE(ValueTarget):
    """BRACE: k-capped V-trace with an anchored Monte-Carlo tail (paper defaults)."""

    def __init__(
        self,
        *,
        gamma: float = 1.0,
        lmbda: float = 1.0,
        rho_bar: float = 1.2,
        c_bar: float = 1.1,
        k: int | None = 100,
        mc_tail: bool = True,
        log_budget: float | None = None,
        rho_in_advantage: bool = False,
    ) -> None:
        """
        Args:
            gamma: discount per action step, in [0, 1].
            lmbda: trace λ, in [0, 1].
            rho_bar: truncation ρ̄ of the per-residual weight, > 0 (paper: 1.2).
            c_bar: truncation c̄ of the trace weights, 0 < c̄ ≤ ρ̄ (paper: 1.1).
            k: most importance factors in any weight product, an int >= 0 (paper: 100);
                None removes the cap (V-trace's target).
            mc_tail: weight residuals past the cap by 1 so they telescope to the realized return
                (paper default); False keeps ρ_t there (the paper's ablation).
            log_budget: also end each correction window, before k, where a trace product leaves
                ``exp(±log_budget)`` (a cap set by the drift, not by a token count; not in the
                paper); None (default) keeps the fixed cap k only.
            rho_in_advantage: scale the actor's advantage by ρ_s = min(ρ̄, π/µ) as V-trace does
                (not in the paper, default False: the actor objective makes the actor-side
                correction); with k = None, BRACE is then V-trace in both outputs.
        """
        F.check_discount("gamma", gamma)
        F.check_discount("lmbda", lmbda)
        F.check_truncation(rho_bar, c_bar)
        F.check_cap(k)
        F.check_log_budget(log_budget)
        require_bool("mc_tail", mc_tail)
        require_bool("rho_in_advantage", rho_in_advantage)
        self.gamma = gamma
        self.lmbda = lmbda
        self.rho_bar = rho_bar
        self.c_bar = c_bar
        self.k = k
        self.mc_tail = mc_tail
        self.log_budget = log_budget
        self.rho_in_advantage = rho_in_advantage

    def __call__(
        self,
        *,
        rewards: torch.Tensor,
        values: torch.Tensor,
        target_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        mask: torch.Tensor,
        group_ids: torch.Tensor | None = None,
        score_sq_norms: torch.Tensor | None = None,
    ) -> ValueTargets:
        return F.brace(
            rewards,
            values,
            target_logprobs,
            behavior_logprobs,
            mask,
            gamma=self.gamma,
            lmbda=self.lmbda,
            rho_bar=self.rho_bar,
            c_bar=self.c_bar,
            k=self.k,
            mc_tail=self.mc_tail,
            log_budget=self.log_budget,
            rho_in_advantage=self.rho_in_advantage,
        )


class GroupRelative(ValueTarget):
    """Base of the critic-free targets: one advantage per response from its prompt group's rewards
    (:func:`brace_lightning.targets.groups.group_advantages`), at every action of the row.

    The sequence reward is the row's summed per-token reward (the verifier's score, plus any
    ``kl_mode="reward"`` penalty). ``returns`` is that reward at the row's actions (the Monte-Carlo
    return, γ = 1), for logging only: no critic regresses it.
    """

    estimator: groups.Estimator

    def __init__(
        self,
        *,
        eps: float = 1e-4,
        baseline_rho_bar: float | None = None,
        optimal_baseline: bool = False,
        score_norm: str = "parameters",
    ) -> None:
        """
        Args:
            eps: added to GRPO's group std (TRL's 1e-4); unused by DrGRPO and RLOO.
            baseline_rho_bar: None (default): the baseline is the group's plain mean (over µ's
                samples). A number ρ̄ > 0: the self-normalised importance-weighted baseline, with
                sequence weights min(ρ̄, π(y)/µ(y)) (the off-policy correction of stale groups;
                ``targets/groups.py``).
            optimal_baseline: VCPO's off-policy optimal baseline: the group's rewards weighted by
                w_i² ‖∇_θ log π_θ(y_i)‖² (w_i the sequence ratio π/µ, truncated at
                ``baseline_rho_bar`` if set). Costs one actor backward per row each step; not
                supported with FSDP2. Default False.
            score_norm: the ‖g_i‖² of ``optimal_baseline``: ``"parameters"`` (default: exact, the
                per-row backward) or ``"logits"``: Σ_t ‖e_{y_t} − π_t‖², the norm with respect to
                the logits (verl's proxy 1 − 2π_t(y_t) + Σπ_t²; one no-grad forward a step,
                FSDP2 included). Read only with ``optimal_baseline=True``.
        """
        if not isinstance(eps, int | float) or isinstance(eps, bool) or not 0.0 <= eps < 1.0:
            raise ValueError(f"eps must be a number in [0, 1); got {eps!r}.")
        if baseline_rho_bar is not None and (
            not isinstance(baseline_rho_bar, int | float)
            or isinstance(baseline_rho_bar, bool)
            or not 0.0 < baseline_rho_bar < math.inf
        ):
            raise ValueError(
                f"baseline_rho_bar must be None or a positive finite number; got "
                f"{baseline_rho_bar!r}."
            )
        require_bool("optimal_baseline", optimal_baseline)
        if score_norm not in ("parameters", "logits"):
            raise ValueError(f"score_norm must be 'parameters' or 'logits'; got {score_norm!r}.")
        if score_norm != "parameters" and not optimal_baseline:
            raise ValueError(
                f"score_norm is read only with optimal_baseline=True; got score_norm={score_norm!r} "
                "with optimal_baseline=False."
            )
        self.eps = eps
        self.baseline_rho_bar = baseline_rho_bar
        self.optimal_baseline = optimal_baseline
        self.score_norm = score_norm

    @property
    def needs_critic(self) -> bool:
        return False

    @property
    def needs_score_norms(self) -> bool:  # type: ignore[override]
        return self.optimal_baseline

    @property
    def uses_importance_weights(self) -> bool:  # type: ignore[override]
        return self.baseline_rho_bar is not None or self.optimal_baseline

    def __call__(
        self,
        *,
        rewards: torch.Tensor,
        values: torch.Tensor,
        target_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        mask: torch.Tensor,
        group_ids: torch.Tensor | None = None,
        score_sq_norms: torch.Tensor | None = None,
    ) -> ValueTargets:
        if group_ids is None:
            raise ValueError(
                f"group_ids must be given to {type(self).__name__} (a [B] int64 tensor of prompt "
                "groups); got None."
            )
        sequence_rewards = torch.where(mask, rewards, 0.0).sum(dim=1)
        weights = None
        if self.baseline_rho_bar is not None or self.optimal_baseline:
            weights = groups.sequence_weights(
                target_logprobs, behavior_logprobs, mask, group_ids, self.baseline_rho_bar
            )
        if self.optimal_baseline:
            if score_sq_norms is None:
                raise ValueError(
                    f"score_sq_norms must be given to {type(self).__name__}(optimal_baseline="
                    "True) (a [B] tensor of each row's squared score-gradient norm); got None."
                )
            weights = groups.optimal_baseline_weights(weights, score_sq_norms, group_ids)
        advantages = groups.group_advantages(
            sequence_rewards, group_ids, self.estimator, eps=self.eps, weights=weights
        )
        return ValueTargets(
            groups.broadcast_to_actions(advantages, mask),
            groups.broadcast_to_actions(sequence_rewards, mask),
        )


class GRPO(GroupRelative):
    """GRPO: (r − group mean) / (group std + eps), std unbiased as TRL's ``GRPOTrainer``."""

    estimator = "GRPO"


class DrGRPO(GroupRelative):
    """Dr. GRPO: r − group mean (no std division); pair it with ``loss_aggregation:
    seq_mean_token_sum`` and a ``loss_max_len``, the aggregation the paper prescribes."""

    estimator = "DrGRPO"


class RLOO(GroupRelative):
    """RLOO: r − the mean of the group's other responses (leave-one-out baseline)."""

    estimator = "RLOO"
