#!/usr/bin/env bash
# Create .venv/ and install brace_lightning with the extras named in $EXTRAS (default: dev).
# CPU machines: torch==2.13.0 is the local CPU wheel (constraints/tested.txt pins it and every other package).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-dev}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet -c constraints/tested.txt -e ".[${EXTRAS}]"
