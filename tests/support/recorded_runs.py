"""Recorded runs: per-step metrics and final weights of a few short CLI runs, kept bit-identical
across refactors (torchtitan's rule: a refactor does not change the loss).

Each run is ``brace-lightning fit`` with the shipped recipes and small overrides, in a subprocess,
with :class:`Recorder` added as a callback: after every rollout step it keeps the deterministic
logged metrics (losses, gradient norms, rewards, weights statistics, counts — not times, memory or
throughput), and at the end it hashes every actor and critic tensor (gathered under FSDP2). The
expected values live in ``tests/data/recorded_runs/<kind>.json``, one file per kind of x86 CPU
(:func:`cpu_kind`: vendor and widest vector unit); after a change that is *meant* to change
training, re-record them on each kind that has a file (the command writes this machine's)::

    .venv/bin/python -m tests.support.recorded_runs --record

and say in the commit why the numbers moved. A new kind's file is recorded from a commit whose runs
pass on a kind that has one (the code's behaviour, measured on the new CPU).

The runs use portable numerics (:data:`PORTABLE_NUMERICS`): ATen's scalar kernels and MKL's
conditional-reproducibility mode. With the CPU's own fast paths, float32 sums round differently
on another CPU (an AMD EPYC with AVX2 against the machine that first recorded them: the
first critic loss differs in the 8th digit), so a recording would only hold on the machine that
made it. They are not enough between an AMD EPYC with AVX2 and an Intel Xeon with AVX-512: there
the runs still differ from step 0 in the 7th–8th digit (2026-12-07; which kernel is not known), so
each kind keeps its own recording, and a kind without one is held to them within a tolerance
(:func:`close_to`).

Run as ``python -m tests.support.recorded_runs OUT -- fit ARGS...`` it is the subprocess driver.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[2]
RECORDINGS = REPO / "tests" / "data" / "recorded_runs"


def cpu_kind(cpuinfo: str | None = None) -> str:
    """This machine's kind of CPU for the recordings: ``<vendor_id>-<avx512|avx2|baseline>`` from
    ``/proc/cpuinfo`` (``cpuinfo``: its text), e.g. ``AuthenticAMD-avx2``; the platform's machine
    name where there is no such file."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if not path.exists():
            return platform.machine() or "unknown"
        cpuinfo = path.read_text()
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", cpuinfo, re.MULTILINE)
    flags = re.search(r"^flags\s*:(.*)$", cpuinfo, re.MULTILINE)
    units = set(flags.group(1).split()) if flags else set()
    widest = "avx512" if "avx512f" in units else "avx2" if "avx2" in units else "baseline"
    return f"{vendor.group(1) if vendor else platform.machine()}-{widest}"


def expected_path(kind: str | None = None) -> Path:
    """The recording of CPU kind ``kind`` (default: this machine's, :func:`cpu_kind`)."""
    return RECORDINGS / f"{kind or cpu_kind()}.json"


#: Tolerance of a run on a CPU kind without a recording: |got − recorded| ≤ ABS + REL · |recorded|.
ABS, REL = 1e-5, 1e-3


def close_to(have: dict[str, float], want: dict[str, float]) -> dict[str, tuple[float, float]]:
    """The metrics of one step that lie outside :data:`ABS` and :data:`REL` of the recorded ones
    (NaN recorded: not compared), as (got, recorded)."""
    return {
        key: (have[key], value)
        for key, value in want.items()
        if value == value and not abs(have[key] - value) <= ABS + REL * abs(value)
    }


#: Logged metrics whose value depends on the clock, the machine or the allocator, and the async
#: producer's progress counters (how far it got ahead of the trainer depends on timing).
NONDETERMINISTIC = (
    "time/",
    "perf/",
    "memory/",
    "idle",
    "tokens_per_s",
    "tok/s",
    "data/queue_depth",
    "data/in_flight",
    "count/buffered",
    "count/generated",
)

#: Environment of every recorded run, so that its float32 arithmetic does not depend on which x86
#: CPU runs it: ATen's kernels without AVX dispatch, MKL's SSE2 path that Intel documents as giving
#: the same results on every Intel and compatible processor, oneDNN capped to SSE4.1.
PORTABLE_NUMERICS = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
}

#: Shared by every run: short, small batches, logs off; the rest is the recipe's.
COMMON = (
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.limit_train_batches=4",
    "--model.critic_warmup_steps=1",
    "--data.prompts_per_step=4",
    "--data.samples_per_prompt=4",
    "--data.engine.init_args.max_new_tokens=16",
    # Every recorded batch has reward 0 (3 warm-start steps): without this the equal-reward rule
    # would skip every actor step and the recordings would no longer pin the actor's path.
    "--model.skip_equal_reward_batches=false",
)
WARM_START = (
    "--trainer.callbacks.init_args.num_pairs=256",
    "--trainer.callbacks.init_args.steps=3",
)

#: name -> CLI arguments after ``fit`` (configs relative to the repository root).
RUNS: dict[str, tuple[str, ...]] = {
    # the quickstart: packed rows, BRACE, PPO clip, lag 0
    "quickstart": ("--config", "configs/quickstart.yaml", *WARM_START, *COMMON),
    # padded micro-batches, a lagged engine, PPO-EWMA and a KL-to-reference loss term
    "padded_lag_ewma_kl": (
        "--config",
        "configs/quickstart.yaml",
        "--config",
        "configs/objectives/ewma.yaml",
        *WARM_START,
        *COMMON,
        "--model.pack_sequences=false",
        "--model.micro_batch_size=3",
        "--model.kl_coef=0.05",
        "--data.lag=1",
        "--data.max_staleness=1",
    ),
    # V-trace with the KL as a reward penalty
    "vtrace_kl_reward": (
        "--config",
        "configs/quickstart.yaml",
        "--config",
        "configs/targets/vtrace.yaml",
        *WARM_START,
        *COMMON,
        "--model.kl_coef=0.05",
        "--model.kl_mode=reward",
        "--model.kl_estimator=k1",
    ),
    # a producer process one version behind (fixed lag: reproducible)
    "async_fixed": (
        "--config",
        "configs/quickstart.yaml",
        "--config",
        "configs/async.yaml",
        *WARM_START,
        *COMMON,
        "--data.max_staleness=1",
        "--data.lag=1",
    ),
    # FSDP2 over two gloo ranks, weights published in buckets
    "fsdp_2rank": (
        "--config",
        "configs/quickstart.yaml",
        "--config",
        "configs/fsdp/cpu_2proc.yaml",
        "--trainer.callbacks=[]",
        *COMMON,
        "--data.prompts_per_step=2",
        "--model.weight_sync_bucket_mb=1",
    ),
}


class Recorder(pl.Callback):
    """Writes ``OUT/record.json`` (global rank 0): deterministic metrics per rollout step and a
    SHA-256 of every actor and critic tensor at the end of ``fit``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        metrics = {
            name: float(value)
            for name, value in trainer.callback_metrics.items()
            if not any(part in name for part in NONDETERMINISTIC) and not name.endswith("_s")
        }
        self.steps.append(dict(sorted(metrics.items())))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        digests = {}
        for name in ("actor", "critic"):
            digest = hashlib.sha256()
            model: torch.nn.Module = getattr(pl_module, name)
            for key, tensor in sorted(model.state_dict().items()):
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                digest.update(key.encode())
                digest.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            digests[name] = digest.hexdigest()
        if trainer.global_rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            record = {"steps": self.steps, "weights_sha256": digests}
            (self.out / "record.json").write_text(json.dumps(record, indent=1))


def run(name: str, out: Path) -> dict[str, Any]:
    """Run recorded run ``name`` in a subprocess; its record."""
    env = {
        **os.environ,
        **PORTABLE_NUMERICS,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
    }
    env.pop("PL_GLOBAL_SEED", None)
    command = [
        sys.executable,
        "-m",
        "tests.support.recorded_runs",
        str(out),
        "--",
        "fit",
        *RUNS[name],
    ]
    command.append(f"--trainer.default_root_dir={out}")  # config.yaml lands there, not in the repo
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(
            f"recorded run {name} failed:\n{done.stdout[-3000:]}{done.stderr[-6000:]}"
        )
    return json.loads((out / "record.json").read_text())


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--record"]:
        import tempfile

        records = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name in argv[1:] or RUNS:
                records[name] = run(name, Path(tmp) / name)
                print(f"recorded {name}", flush=True)
        path = expected_path()
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, **records}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path}", flush=True)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    cut = argv.index("--")
    args = parser.parse_args(argv[:cut])
    torch.set_num_threads(1)
    from brace_lightning.cli import run as cli_run

    cli_run(argv[cut + 1 :], trainer_defaults={"callbacks": [Recorder(args.out)]})


if __name__ == "__main__":
    main()
