"""Off-policyness of the data as torchmetrics: importance-weight statistics and staleness.

Every state is a sum (or, for the largest staleness, a max), so the metrics reduce across processes
and merge with :meth:`torchmetrics.Metric.merge_state` exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from brace_lightning.checks import require_bool
from brace_lightning.metrics.base import KeptDtypeMetric
from brace_lightning.metrics.functional import check_mask

__all__ = ["ImportanceWeightStats", "StalenessHistogram", "StalenessSummary"]


class ImportanceWeightStats(KeptDtypeMetric):
    """Statistics of the per-token importance weights w = π/µ at actions.

    ``compute()`` returns a dict of 0-dim float64 tensors (ready for ``log_dict``), NaN before any
    action:

    - ``log_w_mean``: E[log w] (−KL(µ‖π) per token when the data come from µ);
    - ``w_mean``: E[w] (≈ 1 when µ sampled the data and π is a proper distribution);
    - ``ess``: normalised effective sample size (Σw)² / (n Σw²), in (0, 1];
    - ``clip_fraction_rho`` / ``clip_fraction_c``: fraction of tokens with w > ρ̄ / w > c̄, i.e. whose
      ρ_t = min(ρ̄, w) / c_t = λ min(c̄, w) is truncated;
    - ``log_w_q{q}`` for each requested quantile q (e.g. ``log_w_q0.5``), read from a fixed histogram
      of log w over ``log_w_range`` with linear interpolation inside a bin (resolution
      (hi − lo) / ``num_bins``); mass outside the range is counted and reported at the range's end.

    w is formed in float64; |log w| beyond ~350 overflows Σw² and makes ``ess`` NaN.

    Args:
        rho_bar: ρ̄ > 0 of the value target.
        c_bar: c̄ > 0 of the value target.
        quantiles: quantile levels in (0, 1).
        log_w_range: (lo, hi) of the histogram, lo < hi.
        num_bins: histogram bins inside the range, ≥ 1.

    Update args:
        target_logprobs: ``[B, T]`` log π of the taken tokens.
        behavior_logprobs: ``[B, T]`` log µ of the taken tokens.
        mask: ``[B, T]`` bool, True at actions.
    """

    is_differentiable = False
    full_state_update = False

    n: torch.Tensor
    sum_w: torch.Tensor
    sum_ww: torch.Tensor
    sum_log_w: torch.Tensor
    clipped_rho: torch.Tensor
    clipped_c: torch.Tensor
    histogram: torch.Tensor

    def __init__(
        self,
        rho_bar: float = 1.2,
        c_bar: float = 1.1,
        quantiles: Sequence[float] = (0.05, 0.5, 0.95),
        log_w_range: tuple[float, float] = (-4.0, 4.0),
        num_bins: int = 4000,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        for name, value in (("rho_bar", rho_bar), ("c_bar", c_bar)):
            if not isinstance(value, int | float) or not 0.0 < value < math.inf:
                raise ValueError(f"{name} must be a positive finite number; got {value!r}.")
        if any(not 0.0 < q < 1.0 for q in quantiles):
            raise ValueError(f"quantiles must all be in (0, 1); got {quantiles!r}.")
        low, high = log_w_range
        if not low < high:
            raise ValueError(f"log_w_range must be (lo, hi) with lo < hi; got {log_w_range!r}.")
        if not isinstance(num_bins, int) or num_bins < 1:
            raise ValueError(f"num_bins must be an int >= 1; got {num_bins!r}.")
        self.rho_bar, self.c_bar = float(rho_bar), float(c_bar)
        self.quantiles = tuple(float(q) for q in quantiles)
        self.log_w_range = (float(low), float(high))
        self.num_bins = num_bins
        for name in ("n", "clipped_rho", "clipped_c"):
            self.add_state(name, torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        for name in ("sum_w", "sum_ww", "sum_log_w"):
            self.add_state(name, torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        # Bin 0 counts log w < lo, bin num_bins + 1 counts log w ≥ hi.
        self.add_state(
            "histogram", torch.zeros(num_bins + 2, dtype=torch.long), dist_reduce_fx="sum"
        )

    def update(
        self, target_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> None:
        check_mask(mask, target_logprobs=target_logprobs, behavior_logprobs=behavior_logprobs)
        log_w = (target_logprobs.double() - behavior_logprobs.double())[mask]
        w = log_w.exp()
        self.n += log_w.numel()
        self.sum_w += w.sum()
        self.sum_ww += (w * w).sum()
        self.sum_log_w += log_w.sum()
        self.clipped_rho += (log_w > math.log(self.rho_bar)).sum()
        self.clipped_c += (log_w > math.log(self.c_bar)).sum()
        low, high = self.log_w_range
        position = (log_w - low) / (high - low) * self.num_bins
        index = torch.where(
            log_w < low,
            0,
            torch.where(
                log_w >= high, self.num_bins + 1, position.long().clamp(max=self.num_bins - 1) + 1
            ),
        )
        self.histogram += torch.bincount(index, minlength=self.num_bins + 2)

    def _quantile(self, q: float) -> torch.Tensor:
        low, high = self.log_w_range
        counts = self.histogram.double()
        cdf = counts.cumsum(0)
        rank = q * cdf[-1]
        # First bin whose cumulative count reaches the rank; interpolate inside it.
        bin_ = int(torch.searchsorted(cdf, rank.unsqueeze(0)).clamp(max=self.num_bins + 1))
        if bin_ == 0:
            return counts.new_tensor(low)
        if bin_ == self.num_bins + 1:
            return counts.new_tensor(high)
        below = cdf[bin_] - counts[bin_]
        fraction = (rank - below) / counts[bin_]
        width = (high - low) / self.num_bins
        return low + (bin_ - 1 + fraction) * width

    def compute(self) -> dict[str, torch.Tensor]:
        n = self.n.double()
        out = {
            "log_w_mean": self.sum_log_w / n,
            "w_mean": self.sum_w / n,
            "ess": self.sum_w**2 / (n * self.sum_ww),
            "clip_fraction_rho": self.clipped_rho / n,
            "clip_fraction_c": self.clipped_c / n,
        }
        for q in self.quantiles:
            out[f"log_w_q{q:g}"] = self._quantile(q) if self.n > 0 else n.new_tensor(math.nan)
        return out


class StalenessSummary(NamedTuple):
    """Result of :class:`StalenessHistogram`.

    Attributes:
        counts: ``[max_bucket + 1]`` long; entry g counts staleness g, the last entry every
            staleness ≥ max_bucket.
        mean: 0-dim float64 exact mean staleness (NaN before any sample).
        max: 0-dim long, the largest staleness seen (0 before any sample).
    """

    counts: torch.Tensor
    mean: torch.Tensor
    max: torch.Tensor


class StalenessHistogram(KeptDtypeMetric):
    """Histogram of policy-version gaps of the data a training step consumes.

    Per sample (default) the staleness is ``trainer_version − min(versions over the row's
    actions)``, the definition ``max_staleness`` bounds (``docs/conventions.md``); rows without
    actions are skipped. With ``per_token=True`` every action counts once with its own
    ``trainer_version − version`` (a row sampled across a weight update spans several gaps).

    Args:
        max_bucket: last histogram bucket, ≥ 0; larger gaps are counted there (and in mean/max
            exactly).
        per_token: histogram over action tokens instead of samples.

    Update args:
        versions: ``[B, T]`` long, the policy version that sampled each action.
        mask: ``[B, T]`` bool, True at actions.
        trainer_version: the trainer's current version, an int ≥ every version in the batch.
    """

    is_differentiable = False
    full_state_update = False

    counts: torch.Tensor
    total: torch.Tensor
    num: torch.Tensor
    largest: torch.Tensor

    def __init__(self, max_bucket: int = 64, per_token: bool = False, **kwargs: object) -> None:
        super().__init__(**kwargs)
        if isinstance(max_bucket, bool) or not isinstance(max_bucket, int) or max_bucket < 0:
            raise ValueError(f"max_bucket must be an int >= 0; got {max_bucket!r}.")
        require_bool("per_token", per_token)
        self.max_bucket = max_bucket
        self.per_token = per_token
        self.add_state(
            "counts", torch.zeros(max_bucket + 1, dtype=torch.long), dist_reduce_fx="sum"
        )
        self.add_state("total", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("num", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("largest", torch.zeros((), dtype=torch.long), dist_reduce_fx="max")

    def update(self, versions: torch.Tensor, mask: torch.Tensor, trainer_version: int) -> None:
        check_mask(mask, versions=versions)
        if versions.is_floating_point():
            raise ValueError(f"versions must be an integer tensor; got {versions.dtype}.")
        action_versions = versions[mask].long()
        if action_versions.numel() and int(action_versions.max()) > trainer_version:
            raise ValueError(
                f"trainer_version={trainer_version} is older than a token's version "
                f"{int(action_versions.max())}; expected trainer_version >= every version."
            )
        if self.per_token:
            gaps = trainer_version - action_versions
        else:
            big = torch.iinfo(torch.long).max
            oldest = torch.where(mask, versions.long(), big).amin(dim=1)
            gaps = trainer_version - oldest[mask.any(dim=1)]
        self.counts += torch.bincount(
            gaps.clamp(max=self.max_bucket), minlength=self.max_bucket + 1
        )
        self.total += gaps.sum()
        self.num += gaps.numel()
        if gaps.numel():
            self.largest = torch.maximum(self.largest, gaps.max())

    def compute(self) -> StalenessSummary:
        return StalenessSummary(self.counts, self.total.double() / self.num, self.largest)
