#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -x --durations=15 "$@"
