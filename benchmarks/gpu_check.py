"""The GPU check's vLLM and FSDP2 parts: generation + weight sync, then a few sharded training steps.

    python benchmarks/gpu_check.py                # on a CUDA machine (scripts/gpu_check.sh runs it)
    python benchmarks/gpu_check.py --small        # the same code paths on this CPU, tiny sizes

Builds a Qwen2 model of Qwen2.5-0.5B's shape (896 wide, 24 layers, 14 heads of 64, 2 KV heads; the
character vocabulary, since no tokenizer can be downloaded) from a config with random weights, then

1. vLLM: generates with the in-process :class:`~brace_lightning.rollout.vllm.VLLMEngine`, reports
   tokens/s and the max |log µ − log π| against the trainer's forward on the same weights, pushes new
   weights (``update_weights``) and reports the sync time and the log-prob gap after it;
2. FSDP2: runs a few PPO steps through the CLI with ``ModelParallelStrategy`` on one device
   (``configs/fsdp/cpu_2proc.yaml``'s strategy with ``data_parallel_size: 1``) and reports the step
   time and whether the losses are finite.

Prints one Markdown table; the README quotes it when a GPU run exists.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._common import (
    CONFIGS,
    QUICKSTART,
    REPO,
    cli_command,
    fit_args,
    markdown_table,
    qwen2_config,
)


def _model(small: bool, device: str, seed: int) -> torch.nn.Module:
    from brace_lightning.models.policy import load_causal_lm, tiny_qwen2_config
    from brace_lightning.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    if small:
        config = tiny_qwen2_config(
            len(tokenizer),
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            head_dim=32,
            num_kv_heads=1,
            intermediate_size=256,
            max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    else:
        config = qwen2_config(vocab_size=len(tokenizer), max_positions=1024)
        config.pad_token_id = tokenizer.pad_token_id
        config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    return load_causal_lm(config, seed=seed).to(device).eval()


def _gap(model: torch.nn.Module, out) -> float:
    from brace_lightning.rollout.collect import generation_batch, max_logprob_gap

    return max_logprob_gap(model, generation_batch(out))


def vllm_rows(small: bool, device: str) -> list[tuple[str, str]]:
    from brace_lightning.rollout.vllm import VLLMEngine

    actor, other = _model(small, device, 0), _model(small, device, 1)
    prompts = [[5 + (i % 40), 6 + (i % 30), 7, 8] for i in range(8 if small else 64)]
    new_tokens = 16 if small else 256
    engine = VLLMEngine(
        actor, max_new_tokens=new_tokens, dtype="float32", max_model_len=512, seed=0
    )
    try:
        engine.generate(prompts[:2])  # warm-up
        start = time.perf_counter()
        out = engine.generate(prompts, num_samples=4)
        seconds = time.perf_counter() - start
        tokens = sum(len(r) for r in out.response_ids)
        gap = _gap(actor, out)
        weights = other.state_dict()
        start = time.perf_counter()
        engine.update_weights(weights, 1)
        sync = time.perf_counter() - start
        after = engine.generate(prompts[:8], num_samples=2)
        gap_after = _gap(other, after)
        versions_ok = all(
            v == [1] * len(t) for v, t in zip(after.versions, after.response_ids, strict=True)
        )
    finally:
        engine.close()
    params = sum(p.numel() for p in actor.parameters())
    return [
        ("model", f"Qwen2 {params / 1e6:.0f}M parameters, float32"),
        (
            "vLLM generation",
            f"{tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s",
        ),
        ("vLLM max abs log mu - log pi", f"{gap:.2e}"),
        ("vLLM weight sync (update_weights)", f"{sync * 1000:.0f} ms"),
        (
            "after sync: max abs log mu - log pi",
            f"{gap_after:.2e}; versions {'ok' if versions_ok else 'WRONG'}",
        ),
    ]


def fsdp_rows(small: bool, accelerator: str, steps: int) -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory() as folder:
        command = cli_command(
            fit_args(
                QUICKSTART,
                CONFIGS / "fsdp" / "cpu_2proc.yaml",
                steps=steps,
                callbacks=False,
                log_dir=Path(folder),
                overrides=[
                    f"--trainer.accelerator={accelerator}",
                    "--trainer.devices=1",
                    "--trainer.strategy.init_args.data_parallel_size=1",
                    f"--trainer.default_root_dir={folder}",
                    f"--model.tiny_hidden_size={64 if small else 896}",
                    f"--model.tiny_num_layers={1 if small else 24}",
                    "--model.critic_warmup_steps=0",
                    "--data.prompts_per_step=4",
                    "--data.samples_per_prompt=4",
                    f"--data.engine.init_args.max_new_tokens={12 if small else 64}",
                ],
            )
        )
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            return [("FSDP2 training", f"FAILED (exit {done.returncode}): {tail}")]
        from brace_lightning.logs import read_scalars

        logs = next(Path(folder).rglob("events.out.tfevents.*")).parent
        scalars = read_scalars(str(logs))
        losses = [v for name in ("actor/loss", "critic/loss") for _, v in scalars[name]]
        finite = all(math.isfinite(v) for v in losses)
        step_ms = [v for _, v in scalars.get("time/step_ms", [])]
    per_step = f"; median step {statistics.median(step_ms):.0f} ms" if step_ms else ""
    return [
        (
            f"FSDP2 training ({steps} rollout steps, 1 device)",
            f"{seconds:.1f} s wall{per_step}; losses {'finite' if finite else 'NOT finite'}",
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a CPU dry run")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rows = [("device", torch.cuda.get_device_name() if cuda else "CPU")]
    rows += vllm_rows(args.small, device)
    rows += fsdp_rows(args.small, "gpu" if cuda else "cpu", args.steps)
    print(markdown_table(["check", "result"], rows))


if __name__ == "__main__":
    main()
