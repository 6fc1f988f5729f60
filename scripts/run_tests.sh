#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_env.sh hf  # the tests cover --dataset hf too (pyproject.toml's [hf] extra)
exec .venv/bin/python -m pytest -q --durations=15 "$@"
