#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_env.sh hf,float8  # the tests cover --dataset hf and --float8 too (pyproject.toml's extras)
exec .venv/bin/python -m pytest -q --durations=15 "$@"
