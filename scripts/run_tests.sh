#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests cover --dataset hf and weights in and out ([hf]), and --logger mlflow and wandb ([mlflow], [wandb]).
bash scripts/ensure_env.sh hf,mlflow,wandb
exec .venv/bin/python -m pytest -q --durations=15 "$@"
