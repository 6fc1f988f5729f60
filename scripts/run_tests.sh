#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite: all of it (what CI runs), or with --quick the edit-test loop's
# tier (unit tests and one multi-process smoke test per concern: minutes, not the whole suite's quarter hour).
#   bash scripts/run_tests.sh               # everything
#   bash scripts/run_tests.sh --quick       # the quick tier
#   bash scripts/run_tests.sh tests/loop    # pytest's own arguments pass through (after --quick too)
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests cover --dataset hf and weights in and out ([hf]), --logger mlflow and wandb ([mlflow], [wandb]),
# --float8's emulation ([float8]) and the guide's site ([docs]).
bash scripts/ensure_env.sh hf,mlflow,wandb,float8,docs
if [ "${1:-}" = "--quick" ]; then
    shift
    exec .venv/bin/python -m pytest -q -m "not slow" --durations=10 "$@"
fi
exec .venv/bin/python -m pytest -q --durations=15 "$@"
