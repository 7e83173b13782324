"""How close the forward-only norm proxy comes to the exact norm in VCPO's optimal baseline.

    python -m benchmarks.score_norms [--warm-starts 0 1] [--steps 6] [--lags 0 4]

``GRPO(optimal_baseline=True)`` weighs each response of a prompt group by W_i = w_i² ‖g_i‖²
(docs/value_targets.md). ``score_norm: parameters`` takes ‖g_i‖² exactly (one backward per
response, ``Scorer.score_sq_norms``); ``score_norm: logits`` takes the squared norm of the gradient
with respect to the logits instead (one no-grad forward, ``Scorer.logit_sq_norms``; verl's proxy).
This script runs the counting recipe (``configs/evidence/long_count.yaml``) with the exact overlay
``configs/targets/grpo_opob.yaml`` from a warm-started actor kept in git
(``docs/figures/lm_map/records/warm<W>/actor``, the staleness map's) at a fixed lag, and at every
step computes both norms of the same batch at the same actor. Per lag and warm start it prints,
over the steps' responses (at lag 0 every w_i is 1 and the norms alone set the weights):

- the Spearman rank correlation of the two norms across a step's responses (median over steps);
- within prompt groups, the fraction of response pairs the two norms order the same way;
- the group baselines Σ W r / Σ W with either norm, over the groups whose rewards differ (elsewhere
  every baseline is the common reward): the mean |b_logits − b_exact| beside the mean
  |b_exact − b_mean|, how far the exact weights move the baseline from GRPO's plain group mean.

Descriptive: one run per warm start, no comparison of training outcomes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks._common import CONFIGS, fit_args, markdown_table, target_config
from benchmarks.lm_staleness import RECIPE
from brace_lightning.cli import run
from brace_lightning.scorer import Scorer
from brace_lightning.targets import groups

#: The staleness map's warm-started actors, kept in git (``benchmarks/lm_staleness_map.py``).
WARM_STARTS = CONFIGS.parent / "docs" / "figures" / "lm_map" / "records"


def recorder(records: list[dict[str, torch.Tensor]]) -> Callable[..., dict[str, torch.Tensor]]:
    """A stand-in for ``Scorer.target_inputs`` that returns what it returns (the exact norms) and
    appends, per step, both norms, the sequence ratios, rewards and groups of the batch."""
    original = Scorer.target_inputs

    def target_inputs(
        self: Scorer,
        value_target: Any,
        actor: Any,
        batch: Any,
        plan: Any,
        temperature: float,
        weigh: Any,
    ) -> dict[str, torch.Tensor]:
        inputs = original(self, value_target, actor, batch, plan, temperature, weigh)
        with torch.no_grad():
            proxy = self.logit_sq_norms(actor, batch, plan, temperature, weigh)
            proximal = self.score(actor, batch, plan, temperature)
        ratios = groups.sequence_weights(
            proximal, batch.behavior_logprobs, batch.mask, batch.group_ids, None
        )
        records.append(
            {
                "exact": inputs["score_sq_norms"].cpu(),
                "logits": proxy.cpu(),
                "ratios": ratios.cpu(),
                "rewards": torch.where(batch.mask, batch.rewards, 0.0).sum(1).double().cpu(),
                "groups": batch.group_ids.cpu(),
            }
        )
        return inputs

    return target_inputs


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two ``[N]`` tensors (no ties expected: float norms)."""
    ranks = [x.argsort().argsort().double() for x in (a, b)]
    centred = [r - r.mean() for r in ranks]
    return float((centred[0] * centred[1]).sum() / (centred[0].norm() * centred[1].norm()))


def baselines(record: dict[str, torch.Tensor], norm: str | None) -> dict[int, float]:
    """Per prompt group whose rewards differ: the trainer's group baseline Σ W r / Σ W
    (reward minus DrGRPO's advantage, :func:`~brace_lightning.targets.groups.group_advantages`)
    with W = w² · ``record[norm]`` (:func:`~brace_lightning.targets.groups.
    optimal_baseline_weights`), or the plain mean of the rewards for ``norm`` None."""
    rewards, ids = record["rewards"], record["groups"]
    weights = None
    if norm is not None:
        weights = groups.optimal_baseline_weights(record["ratios"], record[norm], ids)
    baseline = rewards - groups.group_advantages(rewards, ids, "DrGRPO", weights=weights)
    out = {}
    for group in ids.unique().tolist():
        rows = (ids == group).nonzero()[:, 0]
        if bool((rewards[rows] != rewards[rows[0]]).any()):
            out[group] = float(baseline[rows[0]])
    return out


def summarise(records: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """The module docstring's statistics over one run's steps."""
    rhos, agree, pairs, proxy_gap, exact_shift = [], 0, 0, [], []
    for record in records:
        rhos.append(spearman(record["exact"], record["logits"]))
        ids = record["groups"]
        for group in ids.unique().tolist():
            rows = (ids == group).nonzero()[:, 0].tolist()
            for i, a in enumerate(rows):
                for b in rows[i + 1 :]:
                    exact = record["exact"][a] - record["exact"][b]
                    proxy = record["logits"][a] - record["logits"][b]
                    pairs += 1
                    agree += int(bool(exact * proxy > 0))
        exact, proxy, plain = (baselines(record, n) for n in ("exact", "logits", None))
        proxy_gap += [abs(proxy[g] - exact[g]) for g in exact]
        exact_shift += [abs(exact[g] - plain[g]) for g in exact]
    return {
        "steps": len(records),
        "responses": sum(len(r["exact"]) for r in records),
        "spearman": statistics.median(rhos),
        "order": agree / max(pairs, 1),
        "groups": len(proxy_gap),
        "proxy_gap": statistics.fmean(proxy_gap) if proxy_gap else float("nan"),
        "exact_shift": statistics.fmean(exact_shift) if exact_shift else float("nan"),
    }


def one_run(warm: int, steps: int, lag: int, root: Path) -> dict[str, float]:
    """One fit of the counting recipe at ``lag`` with the exact optimal baseline from warm start
    ``warm``."""
    records: list[dict[str, torch.Tensor]] = []
    args = fit_args(
        RECIPE,
        target_config("grpo_opob"),
        seed=warm,
        steps=steps,
        callbacks=False,
        log_dir=root,
        run_name=f"lag{lag}_warm{warm}",
        overrides=[
            f"--model.actor={WARM_STARTS / f'warm{warm}' / 'actor'}",
            f"--data.init_args.lag={lag}",
            f"--data.init_args.max_staleness={max(lag, 1)}",
            "--trainer.max_epochs=1",
            "--trainer.limit_val_batches=0",
        ],
    )
    with mock.patch.object(Scorer, "target_inputs", recorder(records)):
        run(args)
    return summarise(records)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--warm-starts", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for warm in args.warm_starts:
        if not (WARM_STARTS / f"warm{warm}" / "actor").is_dir():
            parser.error(f"--warm-starts: {warm} has no actor at {WARM_STARTS / f'warm{warm}'}")
    if args.steps < 1 or min(args.lags) < 0:
        parser.error(f"--steps must be >= 1 and --lags >= 0; got {args.steps} and {args.lags}")
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for lag in args.lags:
            for warm in args.warm_starts:
                s = one_run(warm, args.steps, lag, Path(root))
                rows.append(
                    [
                        str(lag),
                        str(warm),
                        f"{s['steps']} / {s['responses']}",
                        f"{s['spearman']:.3f}",
                        f"{s['order']:.3f}",
                        f"{s['groups']}",
                        f"{s['proxy_gap']:.4f}",
                        f"{s['exact_shift']:.4f}",
                    ]
                )
    print(f"\ncounting recipe + grpo_opob, {args.steps} steps a run, threads={args.threads}\n")
    header = [
        "lag",
        "warm start",
        "steps / responses",
        "Spearman (median over steps)",
        "same order in group pairs",
        "groups with unequal rewards",
        "mean abs(b_logits − b_exact)",
        "mean abs(b_exact − b_mean)",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
