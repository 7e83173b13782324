#!/usr/bin/env bash
# README's test command: set up .venv/ with the dev and bench extras and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="dev,bench" bash scripts/setup.sh
.venv/bin/python -m pytest tests -q "$@"
