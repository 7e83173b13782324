"""What every benchmark script shares: repository paths, the markdown table writer, the
``brace-lightning fit`` argument builder, the warm start run once for a whole grid, the
Qwen2.5 model shapes, timing medians, peak extra memory and argparse types.

Tables go through one writer (:func:`markdown_table`, or :func:`table_header` then one
:func:`table_row` per measured row), the same one ``brace_lightning.sweep`` writes its
``summary.md`` with, so every printed table has the same form.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import Qwen2Config

from brace_lightning.models.memory import fsdp_bytes_per_rank
from brace_lightning.rollout.orphans import die_with_parent
from brace_lightning.sweep import markdown_table, table_header, table_row

__all__ = [
    "CONFIGS",
    "QUICKSTART",
    "QWEN2_SHAPES",
    "QWEN25_05B",
    "REPO",
    "cli_command",
    "exit_with_parent",
    "fit_args",
    "in_mmap_subprocess",
    "interleaved_median_seconds",
    "markdown_table",
    "median_seconds",
    "model_size",
    "peak_extra_mib",
    "positive_int",
    "proc_kib",
    "qwen2_config",
    "recipe_memory_line",
    "run_mmap_subprocess",
    "stop_with_parent",
    "subprocess_env",
    "table_header",
    "table_row",
    "target_config",
    "warm_start_once",
]

#: The repository root, its recipes, and the recipe most benchmarks run.
REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"


def target_config(name: str) -> Path:
    """The recipe fragment that selects value target ``name`` (``configs/targets/<name>.yaml``)."""
    return CONFIGS / "targets" / f"{name}.yaml"


# ---------------------------------------------------------------------------------- fit runs


def fit_args(
    *configs: Path,
    seed: int | None = None,
    data_seed: int | None = None,
    steps: int | None = None,
    callbacks: bool = True,
    log_dir: Path | None = None,
    run_name: str | None = None,
    overrides: Sequence[str] = (),
) -> list[str]:
    """The arguments of one ``brace-lightning fit`` of a benchmark: the recipe ``configs`` in
    order, then the options below, then ``overrides`` (last, so they win). Every run is quiet: no
    progress bar, model summary or checkpoint files.

    Args:
        configs: YAML files, each a ``--config``.
        seed: ``--seed_everything`` and ``--model.seed``.
        data_seed: ``--data.init_args.seed`` (prompt draws).
        steps: ``--trainer.limit_train_batches`` (rollout steps per epoch).
        callbacks: False drops the recipe's callbacks (``--trainer.callbacks=[]``: its warm start).
        log_dir: the TensorBoard logger's ``save_dir``.
        run_name: the TensorBoard logger's ``name``.
        overrides: further ``--key=value`` arguments.
    """
    args = ["fit"]
    for config in configs:
        args += ["--config", str(config)]
    if seed is not None:
        args += [f"--seed_everything={seed}", f"--model.seed={seed}"]
    if data_seed is not None:
        args.append(f"--data.init_args.seed={data_seed}")
    if steps is not None:
        args.append(f"--trainer.limit_train_batches={steps}")
    if not callbacks:
        args.append("--trainer.callbacks=[]")
    if log_dir is not None:
        args.append(f"--trainer.logger.init_args.save_dir={log_dir}")
    if run_name is not None:
        args.append(f"--trainer.logger.init_args.name={run_name}")
    args += [
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.enable_checkpointing=false",
        *overrides,
    ]
    return args


def cli_command(args: Sequence[str]) -> list[str]:
    """``args`` (such as :func:`fit_args`) as a ``brace-lightning`` command run by this
    interpreter, for a subprocess, through ``benchmarks._follow``: the fit stops when the process
    that started it is gone, so a harness killed mid-grid leaves no fit running (nor a cell that
    a rerun would repeat while the orphan still writes to it)."""
    return [sys.executable, "-m", "benchmarks._follow", "brace_lightning.cli", *args]


def subprocess_env() -> dict[str, str]:
    """The environment of a run in a subprocess: one torch thread, this checkout importable."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO))


def warm_start_once(folder: Path, args: Sequence[str]) -> Path:
    """Run a recipe's ``SupervisedWarmStart`` once for a whole grid; the folder of its actor and
    critic (``folder/actor``, ``folder/critic``: ``brace-lightning export``'s Hugging Face folders).

    Every cell of a grid would otherwise repeat the same warm start (it depends on the recipe and
    its seed, not on the target, objective or lag) at most of a cell's cost. ``args`` are the
    ``fit`` arguments of a run that does the warm start and as little else as possible (no
    rollout step, or one critic warm-up step, which leaves the actor as warm-started); the run
    exports both models when it ends, in a subprocess with :func:`subprocess_env` whose output
    goes to ``folder/stdout.txt`` and ``folder/stderr.txt``. Skipped when the actor is already
    there, so a grid that resumes does not repeat it.
    """
    if (folder / "actor" / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    export = ["--trainer.callbacks+=brace_lightning.export.ExportOnFitEnd"]
    export.append(f"--trainer.callbacks.out={folder}")
    command = cli_command([*args, f"--trainer.default_root_dir={folder}", *export])
    with (folder / "stdout.txt").open("w") as stdout, (folder / "stderr.txt").open("w") as stderr:
        subprocess.run(
            command, cwd=REPO, env=subprocess_env(), stdout=stdout, stderr=stderr, check=True
        )
    return folder


# ------------------------------------------------------------------------------ model shapes

#: Shapes of the checkpoints the GPU recipes and the memory benchmarks name (from their
#: ``config.json``): hidden, intermediate, layers, attention heads, KV heads.
QWEN2_SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": (896, 4864, 24, 14, 2),
    "Qwen/Qwen2.5-1.5B-Instruct": (1536, 8960, 28, 12, 2),
}
QWEN25_05B = "Qwen/Qwen2.5-0.5B-Instruct"


def qwen2_config(
    name: str = QWEN25_05B,
    *,
    layers: int | None = None,
    vocab_size: int = 151_936,
    max_positions: int = 4096,
) -> Qwen2Config:
    """The config of a checkpoint of :data:`QWEN2_SHAPES` (tied embeddings, RoPE base 10^6), with
    ``layers`` blocks instead of its own and a ``vocab_size`` vocabulary when given; models built
    from it have random weights (nothing is downloaded).

    Raises:
        ValueError: for a name outside :data:`QWEN2_SHAPES`.
    """
    if name not in QWEN2_SHAPES:
        raise ValueError(f"qwen2_config got {name!r}; expected one of {', '.join(QWEN2_SHAPES)}.")
    hidden, intermediate, depth, heads, kv_heads = QWEN2_SHAPES[name]
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=depth if layers is None else layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    )


def recipe_memory_line(name: str, world_size: int) -> str:
    """The memory line of a GPU recipe's header for actor ``name`` on ``world_size`` GPUs under
    bf16 compute (the tests check each recipe's header against it)."""
    gib = fsdp_bytes_per_rank(qwen2_config(name), world_size, compute_bytes=2) / 2**30
    return (
        f"# Expected memory per GPU: {gib:.1f} GiB of training state for actor + critic on "
        f"{world_size} GPU(s) (brace_lightning.models.memory.fsdp_bytes_per_rank: fp32 shards, "
        "grads and AdamW / GPUs + one bf16 block gathered per model), plus activations and engine."
    )


# ---------------------------------------------------------------------- timing and memory


def exit_with_parent(parent: int, poll_seconds: float = 1.0) -> None:
    """A process pool's initializer (``initargs=(os.getpid(),)``): the worker exits once the
    process that started it is gone, so a harness killed mid-grid leaves no orphan at work.

    Polled only (no Linux parent-death signal): a pool may start its workers from a thread that
    ends before they do, and the kernel's signal follows the thread."""
    die_with_parent(parent, poll_seconds=poll_seconds, death_signal=False)


def stop_with_parent(parent: int, poll_seconds: float = 1.0, grace_seconds: float = 120.0) -> None:
    """Send this process SIGTERM once its parent ``parent`` is gone, and end it ``grace_seconds``
    later if it still runs: a fit stops as Lightning stops on SIGTERM (at the next batch, its
    teardown and callbacks run), and one that does not, ends anyway."""
    die_with_parent(
        parent, poll_seconds=poll_seconds, stop_signal=signal.SIGTERM, grace_seconds=grace_seconds
    )


def positive_int(text: str) -> int:
    """argparse type of a count option: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {text!r}")
    return int(text)


def model_size(text: str) -> tuple[int, int]:
    """argparse type of a tiny Qwen2 size ``HIDDENxLAYERS`` such as ``64x1``."""
    hidden, _, layers = text.partition("x")
    if not (hidden.isdigit() and layers.isdigit() and int(hidden) > 0 and int(layers) > 0):
        raise argparse.ArgumentTypeError(f"expected HIDDENxLAYERS such as 64x1; got {text!r}")
    return int(hidden), int(layers)


def median_seconds(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs (CUDA-synchronised)."""
    return interleaved_median_seconds({"fn": fn}, repeats=repeats, warmup=warmup)["fn"]


def interleaved_median_seconds(
    fns: dict[str, Callable[[], object]], *, repeats: int = 3, warmup: int = 1
) -> dict[str, float]:
    """Median wall time of every ``fn()`` of ``fns``, the runs taken in turns (one of each per
    round) after ``warmup`` rounds, so that load from other processes on a shared machine falls on
    every case alike rather than on whichever ran while it lasted (CUDA-synchronised)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def in_mmap_subprocess(module: str, args: list[str]) -> str:
    """Run ``python -m module *args`` with glibc's mmap threshold fixed at 64 KiB; its stdout.

    glibc raises its mmap threshold dynamically after the first large free, after which freed
    tensors stay in the heap and the resident high-water mark no longer tracks live tensors. With a
    fixed threshold every tensor above 64 KiB has its own mapping, returned to the OS on free, so
    :func:`peak_extra_mib` is exact. It also slows every allocation, so timings are taken elsewhere.
    """
    return run_mmap_subprocess(module, args, check=True).stdout


def run_mmap_subprocess(
    module: str, args: list[str], *, max_bytes: int | None = None, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """:func:`in_mmap_subprocess`'s child, its output captured; ``max_bytes`` caps its address
    space (``RLIMIT_AS``), so that a run too large for the machine fails in the child with an
    allocation error instead of pushing the machine into swap or the OOM killer."""

    def limit() -> None:
        if max_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        check=check,
        preexec_fn=limit,
    )


def proc_kib(field: str, path: str = "/proc/self/status") -> int:
    """A ``field: N kB`` line of a Linux ``/proc`` file, in KiB (``VmRSS``, ``VmHWM`` of this
    process; ``MemAvailable`` of ``/proc/meminfo``)."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{path} has no {field} line; expected Linux.")


def peak_extra_mib(fn: Callable[[], object], device: str = "cpu") -> float | None:
    """Peak memory ``fn()`` allocates above what was live before it, in MiB.

    CUDA: the allocator's peak counter. CPU (Linux): the process's resident high-water mark, reset
    through ``/proc/self/clear_refs`` before the call (large tensors are mmap-ed and returned on
    free when run under :func:`in_mmap_subprocess`). None where neither is available.
    """
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = proc_kib("VmRSS")
        fn()
        return max(0, proc_kib("VmHWM") - before) / 1024
    except OSError:
        return None
