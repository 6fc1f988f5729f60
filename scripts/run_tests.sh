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
# Two worker processes, each taking whole test files (pytest-xdist's loadfile: a file's fixtures are made once):
# the suite's one-process tests leave one of the two cores idle, which the other worker uses. TEST_WORKERS=0 runs
# every test in pytest's own process, one after the other.
workers=(-n "${TEST_WORKERS:-2}" --dist loadfile)
if [ "${1:-}" = "--quick" ]; then
    shift
    exec .venv/bin/python -m pytest -q "${workers[@]}" -m "not slow" --durations=10 "$@"
fi
exec .venv/bin/python -m pytest -q "${workers[@]}" --durations=15 "$@"
