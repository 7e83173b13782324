#!/usr/bin/env bash
# Regenerate every closed-loop figure and table of docs/results.md:
#   bash scripts/sim_results.sh [OUT_DIR] [WORKERS]
# Runs the eleven grids of sweeps/sim_*.yaml (resumable: finished cells are skipped), then copies each
# grid's summary.md and PNGs to docs/figures/<grid>/. About two hours of one CPU core in all (one
# of them the k-horizon grid's T = 4096 row).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/sim}
workers=${2:-1}
for grid in sim_targets sim_shadow sim_budget sim_staleness sim_k_horizon sim_truncation sim_actor_critic sim_log_budget sim_drift sim_mlp_rules sim_mlp_rules_sparse; do
  OMP_NUM_THREADS=1 .venv/bin/python -m brace_lightning.sweep "sweeps/$grid.yaml" "$out/$grid" --workers "$workers"
  mkdir -p "docs/figures/$grid"
  cp "$out/$grid"/summary.md "$out/$grid"/*.png "docs/figures/$grid/"
done
