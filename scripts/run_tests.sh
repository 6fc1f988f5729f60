#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests cover --dataset hf and weights in and out ([hf]), --logger mlflow and wandb ([mlflow], [wandb])
# and --float8's emulation ([float8]).
bash scripts/ensure_env.sh hf,mlflow,wandb,float8
exec .venv/bin/python -m pytest -q --durations=15 "$@"
