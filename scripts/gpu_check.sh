#!/usr/bin/env bash
# GPU check (one script, under 12 minutes on one GPU): sets up .venv/ with the CUDA builds, then
#   1. the value-target kernels on CUDA (benchmarks/value_targets.py, against TorchRL and a loop),
#   2. vLLM (CUDA build) generation + weight sync, and 3. a few FSDP2 training steps, both on a
#      Qwen2.5-0.5B-shaped model built from a config (benchmarks/gpu_check.py),
#   4. the long-response table of the benchmarks docs on CUDA (benchmarks/long_responses.py: full
#      vs chunked log-probs at T = 1024..8192, padded vs packed micro-batches of 16 responses of
#      64..4096 tokens, the largest single row from 8192 to 32768 tokens).
# Prints the tables; paste them into README.md ("Scaling up").
# The CUDA torch comes from PyTorch's index: TORCH_INDEX (default cu128) picks the build.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1); then
  echo "gpu_check.sh: no CUDA GPU here (nvidia-smi does not answer); nothing to check." >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0" \
    --index-url "https://download.pytorch.org/whl/${TORCH_INDEX:-cu128}"
fi
EXTRAS="dev,bench" bash scripts/setup.sh
bash scripts/install_vllm.sh
export OMP_NUM_THREADS=4
echo "## value-target kernels (CUDA)"
timeout 180 .venv/bin/python benchmarks/value_targets.py --device cuda --repeats 5
echo "## vLLM + FSDP2"
timeout 270 .venv/bin/python benchmarks/gpu_check.py
echo "## long responses (CUDA): full vs chunked log-probs, padded vs packed, the largest row"
timeout 240 .venv/bin/python -m benchmarks.long_responses --device cuda --activation-checkpointing \
  --repeats 3 --largest --ladder-start 8192
