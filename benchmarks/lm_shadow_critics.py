"""Shadow critics on the language model (issue 31): critics trained offline on one recorded stream.

The open-loop critic question: does a corrected value target (V-trace, BRACE) give the language
model's critic a better on-policy score than GAE when the actor's stability cannot decide it? One
actor that survives its lag is recorded, and every critic variant is trained afterwards on that
identical stream, so the variants differ in their targets only.

1. **Record** (``--only record``): per warm-start seed W the recipe's ``SupervisedWarmStart`` runs
   once (:func:`benchmarks.lm_staleness_map.prepare_warm_start`), then per seed N one ``fit`` of the
   counting recipe (``configs/evidence/long_count.yaml``) with ``configs/targets/gae.yaml``, lag 4,
   actor lr 5e-5, 200 rollout steps (the map's command, :func:`benchmarks.lm_staleness_map.
   map_command`) with :class:`brace_lightning.shadow.ShadowRecorder` added: per rollout step v the
   µ-batch with log π_v and a fresh on-policy batch of π_v go to ``<cell>/stream/v{v:05d}.pt``
   (cells under ``OUT/cells/recipe/gae/lag4/lr5e-05/warm<W>/seed<N>/``, with the map's resume
   markers).
2. **Train** (``--only train``): per recorded run, critic variant and budget, a fresh critic (the
   run's initial critic, rebuilt by ``models/build.py``'s ``build_actor_critic`` from the recorded
   construction and checked against its SHA-256) trained on the µ-stream, versions in order: per
   version v the critic's values on the µ-batch (no grad) → the variant's target (log π_v as
   target, log µ as behaviour log-probs) → ``budget`` optimizer steps of the recipe's clipped critic
   loss on the whole µ-batch (AdamW at the recipe's critic lr, its gradient clip) → the score on
   version v's on-policy batch: per-token (V − G)² (the proper score, G the realised return,
   γ = 1) and the signed mean (V − G) by position bin (``metrics.critic_scores``). Variants:
   :data:`VARIANTS`; budgets 2, 8, 32 critic steps per version (the recipe takes 2). One JSON per
   (variant, budget) under ``<cell>/critics/``: its existence is the resume marker. The run's
   per-token |log w| (w = π_v/µ at actions) and truncated log-products at c̄ = 1.1
   (``closed_loop.log_weight_statistics``, windows of k = 100 actions) go to
   ``<cell>/critics/drift.json``.
3. **Aggregate**: ``OUT/scores.json`` (per run, variant, budget and version: mse, bias, bias bins,
   tokens, seconds) and ``OUT/summary.md``: the primary outcome, the secondary tables and the drift
   table.

**Records.** Each finished critic file, the run's ``drift.json`` and the digest of its recorded
stream (:func:`brace_lightning.shadow.stream_sha256`) are kept under ``--records`` (default
``OUT/records``; docs/results_lm.md keeps its in ``docs/figures/lm_shadow/records/``, in git) as
``<records>/warm<W>/seed<N>/``, and the warm starts as the map keeps them (``<records>/warm<W>/
actor``, :func:`benchmarks.lm_staleness_map.prepare_warm_start`). The aggregate reads the records; a critic kept there is restored
instead of trained, a run whose every critic is kept is not recorded again, and a run recorded
again must give the same stream (same digest) before its kept critics are used: the experiment
goes on across machines whose run folders do not survive, and never pools critics of two streams.

PRIMARY OUTCOME, pre-registered by the lead on 2026-12-06 (the text of :data:`PRIMARY_TEXT`):
"mean per-token squared error (V − G)² of the critic on π_v's on-policy batch over versions
101–200, per (variant, budget); each variant against gae at the same budget, paired by recorded
run; Holm over the 7 comparisons per budget; equivalence margin 0.005 (Brier units): a difference
whose 95% interval lies inside ±0.005 is a tie, one that excludes 0 and the margin on one side is
better/worse, otherwise inconclusive (±half-width)". Implementation: version v is rollout step
v − 1 (versions 1–200 of a 200-step run); the per-token mean pools the window's action tokens;
the interval of each comparison is the paired Student-t interval at its Holm step's level
(:func:`brace_lightning.statistics.holm_levels`), and better/worse needs a Holm-adjusted p below
0.05 and that interval beyond +0.005 or below −0.005 (:func:`primary_table`).

The whole experiment (about 45–55 CPU hours for 6 runs on a busy 2-core machine, by the pilot
in ``docs/results_lm.md``; ``--workers N`` trains N critics at a time)::

    .venv/bin/python -m benchmarks.lm_shadow_critics --out runs/lm_shadow --records docs/figures/lm_shadow/records --warm-seeds 0 1 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import exit_with_parent, markdown_table, positive_int
from benchmarks.lm_staleness import RECIPE, run_marked
from benchmarks.lm_staleness_map import MapCell, map_command, prepare_warm_start
from brace_lightning import optim
from brace_lightning.closed_loop import log_weight_statistics
from brace_lightning.metrics import critic_scores
from brace_lightning.metrics.functional import reward_to_go
from brace_lightning.models import build
from brace_lightning.models.microbatch import widen
from brace_lightning.models.sources import load_tokenizer
from brace_lightning.objectives import CriticLoss
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.scorer import Scorer, shift_values
from brace_lightning.shadow import (
    load_meta,
    load_version,
    state_sha256,
    stream_sha256,
    to_batch,
    version_files,
)
from brace_lightning.sweep import copy_atomic, holm_rows, interval, paired_difference, write_marker
from brace_lightning.targets import BRACE, GAE, ValueTarget, VTrace

#: Variant name -> its value target (BRACE at the paper's ρ̄ = 1.2, c̄ = 1.1).
VARIANTS: dict[str, Callable[[], ValueTarget]] = {
    "gae": lambda: GAE(gamma=1.0, lmbda=1.0),
    "gae_l095": lambda: GAE(gamma=1.0, lmbda=0.95),
    "vtrace": lambda: VTrace(),
    "brace_k10": lambda: BRACE(k=10, rho_bar=1.2, c_bar=1.1),
    "brace_k100": lambda: BRACE(k=100, rho_bar=1.2, c_bar=1.1),
    "brace_kinf": lambda: BRACE(k=None, rho_bar=1.2, c_bar=1.1),
    "brace_notail": lambda: BRACE(k=100, rho_bar=1.2, c_bar=1.1, mc_tail=False),
    "brace_lb2": lambda: BRACE(k=100, rho_bar=1.2, c_bar=1.1, log_budget=2.0),
}
REFERENCE = "gae"
BUDGETS = (2, 8, 32)
#: The recorded run: the counting recipe's GAE run at lag 4 and actor lr 5e-5 (survives its lag).
RECORD_TARGET, RECORD_LAG, RECORD_LR = "gae", 4, 5e-5
MARGIN = 0.005
PRIMARY_VERSIONS = (101, 200)
PRIMARY_DATE = "2026-12-06"
PRIMARY_TEXT = (
    "mean per-token squared error (V − G)² of the critic on π_v's on-policy batch over versions "
    "101–200, per (variant, budget); each variant against gae at the same budget, paired by "
    "recorded run; Holm over the 7 comparisons per budget; equivalence margin 0.005 (Brier "
    "units): a difference whose 95% interval lies inside ±0.005 is a tie, one that excludes 0 and "
    "the margin on one side is better/worse, otherwise inconclusive (±half-width)"
)
#: c̄ and window k of the logged truncated log-products (BRACE's defaults; docs/results.md §9).
C_BAR, WINDOW = 1.1, 100


# ---------------------------------------------------------------------------------- record


def record_cell(warm: int, seed: int) -> MapCell:
    """The map cell of the recorded run of warm start ``warm`` and seed ``seed``."""
    return MapCell("recipe", RECORD_TARGET, RECORD_LAG, RECORD_LR, warm, seed)


def stream_folder(cell: MapCell, out: Path) -> Path:
    """Where ``cell``'s recorder writes (``v*.pt`` and ``meta.json``)."""
    return cell.folder(out) / "stream"


def record(
    cell: MapCell,
    out: Path,
    *,
    steps: int,
    every: int,
    recipe: Path,
    on_policy_rows: int,
    extra: Sequence[str],
) -> str:
    """Run ``cell``'s fit with the recorder unless its marker exists (``run_marked``'s status)."""
    if not (cell.folder(out) / "done.json").exists():
        shutil.rmtree(stream_folder(cell, out), ignore_errors=True)  # a failed try's files
    recorder = [
        "--trainer.callbacks+=brace_lightning.shadow.ShadowRecorder",
        f"--trainer.callbacks.folder={stream_folder(cell, out)}",
        f"--trainer.callbacks.on_policy_rows={on_policy_rows}",
    ]
    args = map_command(
        cell, out, steps=steps, every=every, recipe=recipe, extra=[*extra, *recorder]
    )
    return run_marked(cell.folder(out), args, {"cell": cell.__dict__, "shadow": True})


# ---------------------------------------------------------------------------------- train


def initial_critic(meta: dict[str, Any]) -> torch.nn.Module:
    """The recorded run's initial critic, built by the run's own code path
    (``build.build_actor_critic``) from ``meta["critic"]``.

    Raises:
        ValueError: when the rebuilt weights differ from the recorded SHA-256.
    """
    spec = meta["critic"]
    _, critic, _ = build.build_actor_critic(
        spec["actor"],
        tokenizer=load_tokenizer(spec["actor"]),
        hidden_size=spec["tiny_hidden_size"],
        num_layers=spec["tiny_num_layers"],
        seed=spec["seed"],
        critic_from_actor=spec["critic_from_actor"],
        meta_init=False,
    )
    assert critic is not None
    if state_sha256(critic) != spec["initial_sha256"]:
        raise ValueError(
            f"the critic rebuilt from {spec['actor']} differs from the recorded run's initial "
            "critic (SHA-256); expected the same warm-started actor folder and seed."
        )
    return critic


def critic_optimizer(critic: torch.nn.Module, meta: dict[str, Any]) -> torch.optim.Optimizer:
    """AdamW with the recorded run's critic optimizer settings (lr, betas, eps, weight decay).

    Raises:
        ValueError: when the run's critic optimizer was not AdamW.
    """
    settings = meta["critic_optimizer"]
    if settings["class"] != "torch.optim.adamw.AdamW":
        raise ValueError(
            f"the recorded critic optimizer is {settings['class']}; expected torch.optim.AdamW."
        )
    return torch.optim.AdamW(
        critic.parameters(),
        lr=settings["lr"],
        betas=tuple(settings["betas"]),
        eps=settings["eps"],
        weight_decay=settings["weight_decay"],
    )


def offline_scorer(meta: dict[str, Any], critic: torch.nn.Module) -> Scorer:
    """The recorded run's micro-batches: its token budget, packed rows where it packed them."""
    scorer = Scorer(
        micro_batch_size=None,
        max_tokens=meta["max_tokens_per_micro_batch"],
        pack_sequences=bool(meta["recipe"]["pack_sequences"]),
    )
    scorer.prepare(critic, None, ())
    return scorer


def critic_update(
    critic: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scorer: Scorer,
    batch: RolloutBatch,
    target_logprobs: torch.Tensor,
    value_target: ValueTarget,
    *,
    steps: int,
    critic_loss: CriticLoss,
    max_grad_norm: float | None,
) -> None:
    """One version of the offline critic: the critic's values on the µ-batch ``batch`` (no grad)
    → ``value_target``'s returns (``target_logprobs`` = log π_v ``[B, T]``, ``batch``'s
    behaviour log-probs log µ) → ``steps`` optimizer steps of ``critic_loss`` over the whole batch,
    each token loss divided by the batch's action count (the module's aggregation), gradient norm
    clipped at ``max_grad_norm`` (``optim.clipped_step``)."""
    plan = scorer.plan(batch.attention_mask)
    with torch.no_grad():
        old_values = shift_values(scorer.score_values(critic, batch, plan))
    targets = value_target(
        rewards=batch.rewards,
        values=old_values,
        target_logprobs=target_logprobs,
        behavior_logprobs=batch.behavior_logprobs,
        mask=batch.mask,
        group_ids=batch.group_ids,
    )
    tokens = batch.mask.sum()
    width = batch.input_ids.shape[1]
    device = batch.input_ids.device
    for _ in range(steps):
        for micro in plan:
            rows, cols = micro.rows, micro.columns
            ids, attn = batch.input_ids[rows, cols], batch.attention_mask[rows, cols]
            values = widen(scorer.values(critic, ids, attn), cols, width)
            out = critic_loss(
                values=shift_values(values),
                old_values=old_values[rows],
                returns=targets.returns[rows],
                mask=batch.mask[rows],
            )
            (out.token_loss.sum() / tokens).backward()
        optim.clipped_step(critic, optimizer, max_grad_norm, device)


@torch.no_grad()
def score_on_policy(
    critic: torch.nn.Module, scorer: Scorer, batch: RolloutBatch
) -> dict[str, float]:
    """The critic's scores on an on-policy batch against its realised returns (γ = 1):
    ``metrics.critic_scores`` (``value_mse_mc`` the proper score, ``value_bias_mc`` and the
    ``value_bias_pos*`` bins), plus ``tokens``, the action count."""
    values = shift_values(scorer.score_values(critic, batch, scorer.plan(batch.attention_mask)))
    realized = reward_to_go(batch.rewards, batch.mask, gamma=1.0)
    scores = critic_scores()
    scores.update(values, realized, batch.mask)
    result = {name: float(value) for name, value in scores.compute().items()}
    return {**result, "tokens": int(batch.mask.sum())}


def train_variant(
    stream: Path,
    variant: str,
    budget: int,
    *,
    build_critic: Callable[[dict[str, Any]], torch.nn.Module] = initial_critic,
    build_optimizer: Callable[[torch.nn.Module, dict[str, Any]], torch.optim.Optimizer] = (
        critic_optimizer
    ),
) -> list[dict[str, float]]:
    """A fresh critic of ``variant`` trained with ``budget`` steps per version on the recorded
    ``stream``, versions in order; per version its on-policy scores (:func:`score_on_policy`),
    ``version`` (rollout step + 1) and ``seconds`` (the version's update and score)."""
    meta = load_meta(stream)
    critic = build_critic(meta)
    optimizer = build_optimizer(critic, meta)
    scorer = offline_scorer(meta, critic)
    loss = CriticLoss(clip=meta["critic_loss_clip"])
    value_target = VARIANTS[variant]()
    rows = []
    for path in version_files(stream):
        saved = load_version(path)
        start = time.perf_counter()
        train, target_logprobs = to_batch(saved["train"])
        critic_update(
            critic, optimizer, scorer, train, target_logprobs, value_target,
            steps=budget, critic_loss=loss, max_grad_norm=meta["max_grad_norm"],
        )  # fmt: skip
        on_policy, _ = to_batch(saved["on_policy"])
        scores = score_on_policy(critic, scorer, on_policy)
        seconds = time.perf_counter() - start
        rows.append({"version": saved["rollout_step"] + 1, **scores, "seconds": seconds})
    return rows


def _compact_actions(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` values at actions moved to the left of each row (their order kept), and the
    matching mask: windows of consecutive columns are then windows of consecutive actions."""
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    return values.gather(1, order), mask.gather(1, order)


def drift_statistics(stream: Path) -> list[dict[str, float]]:
    """Per recorded version, the µ-batch's per-token |log w| (w = π_v/µ at actions) and truncated
    log-products at c̄ = 1.1 over windows of k = 100 actions (``closed_loop``'s statistics)."""
    rows = []
    for path in version_files(stream):
        saved = load_version(path)
        train, target_logprobs = to_batch(saved["train"])
        log_w = (target_logprobs.double() - train.behavior_logprobs.double()).where(train.mask, 0.0)
        log_w, mask = _compact_actions(log_w, train.mask)
        stats = log_weight_statistics(log_w, mask, c_bar=C_BAR, window=WINDOW)
        rows.append({"version": saved["rollout_step"] + 1, **stats})
    return rows


def critic_file(cell_folder: Path, variant: str, budget: int) -> Path:
    """The scores of one (variant, budget) of a recorded run; its existence is the resume marker."""
    return cell_folder / "critics" / f"{variant}_b{budget}.json"


def train_one(cell_folder: Path, variant: str, budget: int) -> float:
    """Train and score one (variant, budget) of a recorded run into :func:`critic_file` (one torch
    thread, also in a worker process); its seconds."""
    torch.set_num_threads(1)
    start = time.monotonic()
    rows = train_variant(cell_folder / "stream", variant, budget)
    write_marker(critic_file(cell_folder, variant, budget), rows, indent=1)
    return time.monotonic() - start


def keep(path: Path, kept: Path) -> None:
    """Copy a finished file to its record (once); a record that differs is reported, not
    overwritten (the record is what was reported)."""
    if not kept.exists():
        copy_atomic(path, kept)
    elif kept.read_bytes() != path.read_bytes():
        print(f"{path} differs from its record {kept}; the record is kept", flush=True)


def check_stream(folder: Path, kept: Path) -> None:
    """Keep the digest of ``folder``'s recorded stream (:func:`brace_lightning.shadow.
    stream_sha256`) in its record folder ``kept``; a record of another stream stops here, so
    critics trained on two different streams are never pooled.

    Raises:
        SystemExit: when ``kept/stream.json`` holds another digest.
    """
    digest = stream_sha256(folder / "stream")
    path = kept / "stream.json"
    if path.exists():
        recorded = json.loads(path.read_text())["sha256"]
        if recorded != digest:
            raise SystemExit(
                f"the stream recorded in {folder} (sha256 {digest[:12]}) is not the one the "
                f"records in {kept} were trained on ({recorded[:12]}); use another --records."
            )
    else:
        kept.mkdir(parents=True, exist_ok=True)
        write_marker(path, {"sha256": digest}, indent=1)


def train_runs(
    runs: dict[str, Path],
    variants: Sequence[str],
    budgets: Sequence[int],
    *,
    workers: int,
    records: Path,
) -> None:
    """Every missing (variant, budget) of every recorded run in ``runs`` (name -> cell folder),
    in ``workers`` processes, and each run's drift statistics; prints one line per pair. Each
    finished file is kept under ``records/<name>/critics/``; a pair already kept there (for the
    same stream, :func:`check_stream`) is restored from it instead of trained."""
    jobs = []
    for name, folder in runs.items():
        kept = records / name
        check_stream(folder, kept)
        (folder / "critics").mkdir(parents=True, exist_ok=True)
        drift = folder / "critics" / "drift.json"
        if not drift.exists():
            write_marker(drift, drift_statistics(folder / "stream"), indent=1)
        keep(drift, kept / "critics" / "drift.json")
        for variant in variants:
            for budget in budgets:
                local, record = (
                    critic_file(folder, variant, budget),
                    critic_file(kept, variant, budget),
                )
                if local.exists():
                    keep(local, record)
                    print(f"train {name} {variant} budget {budget}: skipped", flush=True)
                elif record.exists():
                    copy_atomic(record, local)
                    print(
                        f"train {name} {variant} budget {budget}: restored from {record}",
                        flush=True,
                    )
                else:
                    jobs.append((name, folder, variant, budget))

    def finished(name: str, folder: Path, variant: str, budget: int, seconds: float) -> None:
        keep(critic_file(folder, variant, budget), critic_file(records / name, variant, budget))
        print(f"train {name} {variant} budget {budget}: done in {seconds:.0f} s", flush=True)

    if workers == 1:
        for name, folder, variant, budget in jobs:
            finished(name, folder, variant, budget, train_one(folder, variant, budget))
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=exit_with_parent, initargs=(os.getpid(),)
    ) as pool:
        futures = {pool.submit(train_one, f, v, b): (n, f, v, b) for n, f, v, b in jobs}
        for future in as_completed(futures):
            finished(*futures[future], future.result())


def complete(kept: Path, variants: Sequence[str], budgets: Sequence[int]) -> bool:
    """Whether the record folder ``kept`` holds every (variant, budget) and the drift: its run
    need not be recorded again."""
    files = [critic_file(kept, v, b) for v in variants for b in budgets]
    return all(path.exists() for path in [*files, kept / "critics" / "drift.json"])


# ---------------------------------------------------------------------------------- aggregate

Scores = dict[str, dict[str, dict[int, list[dict[str, float]]]]]  # run -> variant -> budget -> rows


def read_scores(runs: dict[str, Path], variants: Sequence[str], budgets: Sequence[int]) -> Scores:
    """The finished (variant, budget) files of every run folder in ``runs`` (name -> folder)."""
    scores: Scores = {}
    for name, folder in runs.items():
        for variant in variants:
            for budget in budgets:
                path = critic_file(folder, variant, budget)
                if path.exists():
                    rows = json.loads(path.read_text())
                    scores.setdefault(name, {}).setdefault(variant, {})[budget] = rows
    return scores


def window_mse(rows: list[dict[str, float]], first: int, last: int) -> float:
    """Per-token mean of (V − G)² pooled over the action tokens of versions ``first``–``last``
    (inclusive; NaN when none is there)."""
    chosen = [r for r in rows if first <= r["version"] <= last]
    tokens = sum(r["tokens"] for r in chosen)
    if not tokens:
        return math.nan
    return sum(r["value_mse_mc"] * r["tokens"] for r in chosen) / tokens


def outcome(scores: Scores, versions: tuple[int, int]) -> dict[tuple[str, int], dict[str, float]]:
    """The primary metric per (variant, budget), by run: :func:`window_mse` over ``versions``."""
    table: dict[tuple[str, int], dict[str, float]] = {}
    for run, by_variant in scores.items():
        for variant, by_budget in by_variant.items():
            for budget, rows in by_budget.items():
                value = window_mse(rows, *versions)
                if not math.isnan(value):
                    table.setdefault((variant, budget), {})[run] = value
    return table


def primary_table(
    values: dict[tuple[str, int], dict[str, float]], budget: int, *, margin: float = MARGIN
) -> list[list[Any]]:
    """The pre-registered family at one ``budget``: each variant minus ``gae``, paired by run,
    Student-t p-value, Holm over the family, the interval at each comparison's Holm step's level;
    better/worse (lower is better) when the Holm-adjusted p < 0.05 and that interval lies beyond
    ±``margin`` on one side, a tie when it lies inside ±``margin``, else inconclusive (±half-width).
    Rows: variant, runs, difference [interval] (level), p, Holm p, verdict."""
    reference = values.get((REFERENCE, budget), {})
    family = []
    for variant in VARIANTS:
        by_run = values.get((variant, budget), {})
        shared = sorted(set(by_run) & set(reference))
        if variant == REFERENCE or len(shared) < 2:
            continue
        family.append((variant, [by_run[run] - reference[run] for run in shared]))
    return holm_rows(family, higher_is_better=False, margin=margin, beyond_margin=True)


def _bin_start(key: str) -> int:
    """Sort key of ``value_bias_mc`` (first) and the ``value_bias_pos{a}_{b}`` bins (by a)."""
    return -1 if key == "value_bias_mc" else int(key.removeprefix("value_bias_pos").split("_")[0])


def _mean_text(values: list[float], digits: int = 4) -> str:
    if len(values) < 2:
        return f"{values[0]:.{digits}f}" if values else "-"
    mean, low, high = interval(values)
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def _early_section(scores: Scores, budgets: Sequence[int], first: int) -> list[str]:
    """Secondary: each variant minus gae over versions 1 to ``first`` − 1, 95% paired interval
    and verdict per budget, unadjusted (``sweep.paired_difference``, margin ±0.005)."""
    early = outcome(scores, (1, first - 1))
    rows = []
    for budget in budgets:
        reference = early.get((REFERENCE, budget), {})
        for variant in VARIANTS:
            by_run = early.get((variant, budget), {})
            if variant == REFERENCE or len(set(by_run) & set(reference)) < 2:
                continue
            d, low, high, word = paired_difference(
                by_run, reference, higher_is_better=False, margin=MARGIN
            )
            rows.append([budget, variant, f"{d:+.4f} [{low:+.4f}, {high:+.4f}]", word])
    if not rows:
        return []
    title = f"**secondary: Δ (V − G)² vs gae over versions 1–{first - 1} (95% CI, unadjusted)**"
    return [f"{title}\n\n" + markdown_table(["budget", "variant", "Δ", "verdict"], rows)]


def _bias_section(scores: Scores, budgets: Sequence[int], versions: tuple[int, int]) -> list[str]:
    """Secondary: the signed mean (V − G), overall and by position bin, over ``versions``
    (the mean of the versions' values, over versions and runs)."""
    first, last = versions
    rows, keys = [], []
    for variant in VARIANTS:
        for budget in budgets:
            chosen = [
                row
                for by_variant in scores.values()
                for row in by_variant.get(variant, {}).get(budget, [])
                if first <= row["version"] <= last
            ]
            if not chosen:
                continue
            keys = sorted((k for k in chosen[0] if k.startswith("value_bias_")), key=_bin_start)
            cells = [sum(r[k] for r in chosen) / len(chosen) for k in keys]
            rows.append([variant, budget, *(f"{c:+.4f}" for c in cells)])
    if not rows:
        return []
    title = (
        f"**secondary: signed mean (V − G) over versions {first}–{last} (mean of versions and "
        "runs)**"
    )
    return [f"{title}\n\n" + markdown_table(["variant", "budget", *keys], rows)]


def _drift_section(drift: dict[str, list[dict[str, float]]]) -> list[str]:
    """Secondary: each run's importance-weight statistics, the mean over its versions."""
    keys = ("abs_mean", "abs_p50", "abs_p90", "abs_p99", "product_mean", "window_mean")
    rows = [
        [run, *(f"{sum(r[k] for r in rows) / len(rows):.3g}" for k in keys)]
        for run, rows in sorted(drift.items())
    ]
    if not rows:
        return []
    header = ["run", "mean \\|log w\\|", "p50", "p90", "p99", "log Π_T", f"log Π_{WINDOW}"]
    title = (
        f"**secondary: the µ-batches' importance weights, mean over versions (c̄ = {C_BAR}, "
        f"windows of {WINDOW} actions; docs/results.md §9's drift axis)**"
    )
    return [f"{title}\n\n" + markdown_table(header, rows)]


def summary(
    scores: Scores,
    drift: dict[str, list[dict[str, float]]],
    budgets: Sequence[int],
    versions: tuple[int, int],
) -> str:
    """Markdown: the primary family per budget, then (secondary) the levels, the early-window
    differences, the signed bias by position and the drift table."""
    values = outcome(scores, versions)
    first, last = versions
    window = f"Versions {first}–{last}; {len(scores)} recorded run(s)."
    if versions != PRIMARY_VERSIONS:
        window += (
            " **Not the pre-registered window (--primary-versions): not the primary outcome.**"
        )
    sections = [
        f"### Primary outcome (pre-registered {PRIMARY_DATE})\n\n{PRIMARY_TEXT}.\n\n{window}"
    ]
    header = ["variant", "runs", "Δ (V − G)² vs gae [Holm-level CI]", "p", "Holm p", "verdict"]
    for budget in budgets:
        rows = primary_table(values, budget)
        body = markdown_table(header, rows) if rows else "(fewer than 2 paired runs)"
        sections.append(f"**budget {budget} critic steps per version**\n\n{body}")
    level_rows = []
    for variant in VARIANTS:
        row: list[Any] = [variant]
        for budget in budgets:
            row.append(_mean_text(list(values.get((variant, budget), {}).values())))
        level_rows.append(row)
    sections.append(
        f"**secondary: (V − G)² over versions {first}–{last}, mean over runs [95% CI]**\n\n"
        + markdown_table(["variant", *(f"budget {b}" for b in budgets)], level_rows)
    )
    sections += _early_section(scores, budgets, first)
    sections += _bias_section(scores, budgets, versions)
    sections += _drift_section(drift)
    return "\n\n".join(sections)


def aggregate(
    runs: dict[str, Path], out: Path, budgets: Sequence[int], versions: tuple[int, int]
) -> str:
    """Write ``OUT/scores.json`` and ``OUT/summary.md`` from every finished file; the summary."""
    scores = read_scores(runs, list(VARIANTS), budgets)
    drift = {
        name: json.loads((folder / "critics" / "drift.json").read_text())
        for name, folder in runs.items()
        if (folder / "critics" / "drift.json").exists()
    }
    write_marker(out / "scores.json", scores, indent=1)
    text = summary(scores, drift, budgets, versions)
    (out / "summary.md").write_text(text + "\n")
    return text


# ---------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: record the missing runs, train the missing critics, then aggregate."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder (reused to resume)")
    parser.add_argument("--warm-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--steps", type=positive_int, default=200, help="rollout steps per recorded run"
    )
    parser.add_argument(
        "--every", type=positive_int, default=20, help="validate every this many steps"
    )
    parser.add_argument("--on-policy-rows", type=positive_int, default=32, help="per version")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=list(BUDGETS))
    parser.add_argument(
        "--primary-versions", type=int, nargs=2, default=list(PRIMARY_VERSIONS),
        metavar=("FIRST", "LAST"), help="the primary window (pre-registered: 101 200)",
    )  # fmt: skip
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="critic-training processes (one torch thread each)",
    )
    parser.add_argument(
        "--records",
        type=Path,
        default=None,
        help="where each finished critic file (and each run's stream digest and drift) is kept and "
        "restored from, per run (default: OUT/records; docs/results_lm.md keeps its in "
        "docs/figures/lm_shadow/records)",
    )
    parser.add_argument("--only", choices=["record", "train", "aggregate"], default=None)
    parser.add_argument("--config", type=Path, default=RECIPE, help="the recipe")
    parser.add_argument("extra", nargs="*", help="more CLI overrides for every fit, after --")
    args = parser.parse_args(argv)
    if args.steps < args.every or args.steps % args.every:
        parser.error(f"--steps ({args.steps}) must be a multiple of --every ({args.every}).")
    first, last = args.primary_versions
    if not 1 < first <= last:
        parser.error(f"--primary-versions must be 1 < FIRST <= LAST; got {first} {last}.")
    cells = [record_cell(w, s) for w in args.warm_seeds for s in args.seeds]
    args.out.mkdir(parents=True, exist_ok=True)
    records = args.records if args.records is not None else args.out / "records"
    names = {cell: f"warm{cell.warm}/seed{cell.seed}" for cell in cells}
    if args.only in (None, "record"):
        todo = [c for c in cells if not complete(records / names[c], args.variants, args.budgets)]
        for cell in cells:
            if cell not in todo:
                print(f"record {cell}: every critic is in {records / names[cell]}", flush=True)
        for warm in dict.fromkeys(cell.warm for cell in todo):
            status = prepare_warm_start(args.out, warm, args.config, args.extra, records)
            print(f"warm start {warm}: validation {status}", flush=True)
        for cell in todo:
            start = time.monotonic()
            status = record(
                cell, args.out, steps=args.steps, every=args.every, recipe=args.config,
                on_policy_rows=args.on_policy_rows, extra=args.extra,
            )  # fmt: skip
            print(f"record {cell}: {status} in {time.monotonic() - start:.0f} s", flush=True)
    recorded = {
        names[c]: c.folder(args.out) for c in cells if (c.folder(args.out) / "done.json").exists()
    }
    if args.only in (None, "train"):
        train_runs(recorded, args.variants, args.budgets, workers=args.workers, records=records)
    kept = {
        names[c]: records / names[c] for c in cells if (records / names[c] / "critics").exists()
    }
    text = aggregate(kept, args.out, args.budgets, (first, last))
    print(text)
    missing = [str(c) for c in cells if names[c] not in recorded and names[c] not in kept]
    if missing:
        print(f"runs neither recorded nor in the records ({len(missing)}): " + ", ".join(missing))


if __name__ == "__main__":
    main()
