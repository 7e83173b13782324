#!/usr/bin/env bash
# README's main job: set up .venv/ and train the quickstart recipe (BRACE, tiny model, CPU).
# TensorBoard logs land in runs/quickstart/<task>-<target>-<objective>-<staleness>/version_N/ (tensorboard --logdir runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/brace-lightning fit --config configs/quickstart.yaml "$@"
