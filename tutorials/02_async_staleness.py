# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 — Asynchronous rollouts: versions, staleness, and a small staleness sweep
#
# With `AsyncRolloutDataModule` a producer generates the next rollout batches while the trainer
# trains on the current one, with the weights the trainer publishes after every step. Every action
# token records the policy version that sampled it; a sample's *staleness* is
# `trainer_version − min(token versions)`, and `max_staleness = S` bounds it: batch n is requested
# only once step n − S is complete, so at most S + 1 batches are generated ahead of the trainer.
#
# We train the quickstart's tiny model on CPU with a producer *process* (generation and training
# on different cores), then read back from TensorBoard what the data module logged: the version
# timeline, the staleness histogram and the sample counters. Last, a small sweep over S with
# reproducible lag (`lag=S`) compares the GAE and BRACE value targets.
#
# Sizes are cut down so that the notebook runs in a few minutes on two cores;
# `brace-lightning fit --config configs/quickstart.yaml --config configs/async.yaml` is the
# full-size recipe.

# %%
import functools
import tempfile

import lightning.pytorch as pl
import matplotlib.pyplot as plt
import torch

from brace_lightning.callbacks import SupervisedWarmStart
from brace_lightning.data import ASYNC_COUNTERS, AsyncRolloutDataModule
from brace_lightning.logs import read_scalars
from brace_lightning.module import BraceModule
from brace_lightning.rollout import EmbeddedEngine
from brace_lightning.targets import BRACE, GAE
from brace_lightning.tasks import ArithmeticReward, ArithmeticTask

torch.set_num_threads(1)  # the trainer gets one core, the producer process the other
log_root = tempfile.mkdtemp(prefix="brace-async-")


# %% [markdown]
# One function builds a run: the same `BraceModule` and Lightning `Trainer` as in tutorial 00, with
# the asynchronous data module in place of `RolloutDataModule`. The producer is a spawned process,
# so what it receives must be picklable and importable: the reward is a package class and the engine
# factory a `functools.partial` of `EmbeddedEngine` (a lambda or a class defined in a notebook cell
# would need `producer="thread"`). The task stays in the training process, which draws the prompts.


# %%
def train(value_target, *, max_staleness, lag, steps, name, producer="process"):
    """Warm-start, then run ``steps`` rollout steps; returns (log folder, data module)."""
    pl.seed_everything(0)
    module = BraceModule(
        actor="tiny-char",
        tiny_hidden_size=64,
        tiny_num_layers=1,
        value_target=value_target,
        actor_optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
        critic_optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        critic_warmup_steps=2,
        num_minibatches=2,
    )
    data = AsyncRolloutDataModule(
        task=ArithmeticTask(num_operands=2, max_value=9, ops="+"),
        reward=ArithmeticReward(),
        engine=functools.partial(EmbeddedEngine, temperature=1.0, max_new_tokens=12),
        prompts_per_step=8,
        samples_per_prompt=4,
        max_staleness=max_staleness,
        lag=lag,
        producer=producer,
        producer_threads=1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=steps,
        log_every_n_steps=1,  # one training step is one rollout step; Lightning's default is 50
        logger=pl.loggers.TensorBoardLogger(log_root, name=name),
        callbacks=[SupervisedWarmStart(num_pairs=2000, steps=300, batch_size=64)],
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, datamodule=data)
    return trainer.logger.log_dir, data


# %% [markdown]
# ## An asynchronous run
#
# S = 2 with `lag=None`: before each batch the producer installs the newest weights it has,
# so how stale a batch is depends on timing — how far ahead the producer got while the trainer
# trained. The first two steps only train the critic (`critic_warmup_steps=2`), so they publish no
# new weights.

# %%
STEPS = 12
log_dir, data = train(
    BRACE(),
    max_staleness=2,
    lag=None,
    steps=STEPS,
    name="async",
)
scalars = read_scalars(log_dir)
print("producer:", data.producer_info)  # a separate process with its own pid
print(sorted(name for name in scalars if name.startswith("data/")))


# %% [markdown]
# ## The version timeline
#
# `policy_version` is the trainer's version after each rollout step, so the batch of step n was
# consumed at the version logged for step n − 1. `data/engine_version` is the version the producer
# held when it finished the batch. Without `interruptible=True` (the default) a batch is sampled
# with one version, so every token of it has that version and its staleness (`data/staleness_max`,
# = `data/staleness_mean`) is the gap between the two curves.


# %%
def series(run: dict, name: str) -> list[float]:
    """The values of scalar ``name``, one per rollout step."""
    return [value for _, value in run[name]]


steps = [step for step, _ in scalars["policy_version"]]
consumed_at = [0.0, *series(scalars, "policy_version")[:-1]]
sampled_with = series(scalars, "data/engine_version")
staleness = series(scalars, "data/staleness_max")
assert staleness == series(scalars, "data/staleness_mean")
assert staleness == [t - b for t, b in zip(consumed_at, sampled_with, strict=True)]

fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
axes[0].plot(steps, consumed_at, marker="o", label="trainer version when consumed")
axes[0].plot(steps, sampled_with, marker="v", label="version the batch was sampled with")
axes[0].fill_between(steps, sampled_with, consumed_at, alpha=0.2, label="staleness")
axes[0].set_xlabel("rollout step")
axes[0].set_ylabel("policy version")
axes[0].legend()
axes[1].plot(steps, staleness, marker="o", label="data/staleness_max")
axes[1].plot(steps, series(scalars, "data/queue_depth"), marker=".", label="data/queue_depth")
axes[1].plot(steps, series(scalars, "data/in_flight"), marker=".", label="data/in_flight")
axes[1].axhline(data.max_staleness, color="gray", linestyle="--", label="max_staleness S")
axes[1].set_xlabel("rollout step")
axes[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# The first three batches are consumed at version 0: the two critic warm-up steps publish nothing,
# and step 3 is the first actor update. From then on the producer works ahead: once the trainer has
# taken a batch, the batches requested but not finished (`data/in_flight`) plus those finished and
# waiting (`data/queue_depth`) are at most S, so no batch is more than S versions old when it is
# trained on. How stale each one is depends on timing: here generating a batch is faster than
# training on it (the producer idles, see below), so the producer is usually the full S ahead and
# most batches are S versions old. A slower producer (longer answers, a bigger model) tends to give
# fresher batches and an idle trainer instead.

# %% [markdown]
# ## The staleness histogram
#
# `data/staleness_frac/k` (k = 0 … S) is the share of a step's trained samples that are k versions
# old; weighting each step by the samples it trained (the increments of `data/count/trained`) gives
# the histogram of the whole run. Nothing lies above S: admission guarantees it, and a sample
# above S at consume time would be dropped and counted as `dropped_stale`.

# %%
trained = series(scalars, "data/count/trained")
per_step = [b - a for a, b in zip([0.0, *trained[:-1]], trained, strict=True)]
histogram = {}
for k in range(data.max_staleness + 1):
    fractions = series(scalars, f"data/staleness_frac/{k}")
    histogram[k] = sum(f * n for f, n in zip(fractions, per_step, strict=True)) / sum(per_step)

fig, ax = plt.subplots(figsize=(5, 3.5))
ax.bar(list(histogram), list(histogram.values()))
ax.set_xticks(list(histogram))
ax.set_xlabel("staleness k (versions behind the trainer)")
ax.set_ylabel("fraction of trained samples")
fig.tight_layout()
plt.show()
print({k: round(v, 3) for k, v in histogram.items()})
print(
    f"idle fractions of the wall time: trainer "
    f"{series(scalars, 'data/trainer_idle_fraction')[-1]:.2f}, producer "
    f"{series(scalars, 'data/producer_idle_fraction')[-1]:.2f}"
)

# %% [markdown]
# ## Conservation
#
# Every generated sample is trained on, dropped (too stale, a failing reward, no action token) or
# still buffered: `data/count/*` logs the running totals at every step. After `fit` the data
# module's own counters also hold what the producer finished after the last step (the weights
# published by the last step admit more batches); those samples count as buffered.

# %%
logged = [
    {name: scalars[f"data/count/{name}"][i][1] for name in ASYNC_COUNTERS}
    for i in range(len(steps))
]
for counts in [*logged, data.counters]:
    dropped = counts["dropped_stale"] + counts["dropped_reward_error"] + counts["dropped_empty"]
    assert counts["generated"] == counts["trained"] + dropped + counts["buffered"], counts
print("last step:", logged[-1])
print("after fit:", data.counters)

# %% [markdown]
# ## A small staleness sweep: GAE vs BRACE
#
# `lag=S` (equal to `max_staleness`) makes the producer sample batch n with the weights of exactly version
# v(n − S), whatever the timing, so each run is reproducible and every batch is exactly S versions
# old once the actor has trained S steps. For S ∈ {0, 2, 4} we train with three value targets:
#
# - GAE with λ = 1 — the Monte-Carlo return, PPO's usual critic target;
# - BRACE with the paper's defaults (k = 100, ρ̄ = 1.2, c̄ = 1.1). The answers here are about ten
#   tokens long, shorter than k, so no weight product is ever capped: on this task it is truncated
#   V-trace;
# - BRACE with k = 4, so that the cap and the Monte-Carlo tail act within these short responses.
#
# We report the reward, how far the trained policy π has moved from the behavior policy µ
# (`kl/pi_mu`, the per-token KL(π‖µ) estimated on the batch) and `critic/beta`, which the trainer
# logs at every step: the least-squares slope of the critic's target on the realized return in the
# longest remaining-horizon bin (paper Fig. 2b; tutorial 01 shows it with exact ground truth). GAE
# with λ = 1 regresses the return itself, so its β is 1 by construction; an importance-weighted
# target's β falls below 1 on stale data, and the cap k bounds how far.
#
# Fixed lag makes the batches independent of timing, so the sweep uses `producer="thread"`: the
# numbers are the same kind as with a producer process, without its start-up (a few seconds of
# imports per run).

# %%
SWEEP_STEPS = 16
targets = {"GAE": GAE, "BRACE": BRACE, "BRACE k=4": functools.partial(BRACE, k=4)}
sweep = {}
for s in (0, 2, 4):
    for target_name, target in targets.items():
        run_dir, _ = train(
            target(),
            max_staleness=s,
            lag=s,
            steps=SWEEP_STEPS,
            name=f"S{s}-{target_name}",
            producer="thread",
        )
        sweep[s, target_name] = read_scalars(run_dir)


# %%
def tail_mean(run: dict, name: str, last: int = 6) -> float:
    """Mean of the last ``last`` steps of scalar ``name``: single steps of 32 samples are noisy."""
    values = series(run, name)[-last:]
    return sum(values) / len(values)


print(f"{'S':>2} {'target':10} {'staleness':>9} {'reward':>7} {'KL(π‖µ)':>8} {'β':>6}")
for (s, target_name), run in sweep.items():
    print(
        f"{s:>2} {target_name:10} {tail_mean(run, 'data/staleness_max'):9.2f} "
        f"{tail_mean(run, 'rollout/reward'):7.3f} {tail_mean(run, 'kl/pi_mu'):8.4f} "
        f"{tail_mean(run, 'critic/beta'):6.3f}"
    )

linestyles = {"GAE": ":", "BRACE": "-", "BRACE k=4": "--"}
fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
for (s, target_name), run in sweep.items():
    style = dict(color=f"C{s // 2}", linestyle=linestyles[target_name])
    label = f"S={s} {target_name}"
    axes[0].plot(*zip(*run["rollout/reward"], strict=True), marker=".", label=label, **style)
    axes[1].plot(*zip(*run["critic/beta"], strict=True), marker=".", label=label, **style)
axes[0].set_title("rollout/reward")
axes[1].set_title("critic/beta")
for ax in axes:
    ax.set_xlabel("rollout step")
axes[0].legend(ncol=3, fontsize="small")
fig.tight_layout()
plt.show()

# %% [markdown]
# What to look at: in every fixed-lag run the last batches are exactly S versions old, and at
# S = 0 (synchronous on-policy PPO, π = µ) the three targets coincide — same rewards, β = 1. With
# stale data the KL between π and µ grows with S, BRACE's β drops below 1 and the k = 4 cap keeps it
# higher than the uncapped product does. That is a statement about the targets, not about learning:
# the rewards of 16 steps of 32 samples from a tiny model are noise (they differ between runs by
# more than any effect of the target), and a real comparison needs the full recipe over several
# seeds (`benchmarks/learning_curves.py`). `benchmarks/async_speedup.py` measures the wall-time gain
# of overlapping generation with training.
#
# `critic/explained_variance` is logged too, but it is computed per batch and divides by the
# variance of the batch's returns: it is NaN on a batch where every answer gets the same reward and
# erratic when nearly every one does (common at this size), so it is left out of the table.
