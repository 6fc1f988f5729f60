#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite: all of it (what CI runs), or with --quick the edit-test loop's
# tier (unit tests and one multi-process smoke test per concern: minutes, not the whole suite's twenty).
#   bash scripts/run_tests.sh               # everything
#   bash scripts/run_tests.sh --quick       # the quick tier
#   bash scripts/run_tests.sh tests/loop    # pytest's own arguments pass through (after --quick too)
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests cover --dataset hf and weights in and out ([hf]), --logger mlflow and wandb ([mlflow], [wandb]),
# --float8's emulation ([float8]), the guide's site ([docs]), the side-by-side with transformers' Trainer
# ([hf-trainer]), the sweep's --search with its plots ([search], [plots]), --fault-tolerance ([ft]), --ray-workers
# ([ray]) and the TrainJob of --k8s read through Kubeflow Trainer's API model ([k8s]); [lint] brings ruff and mypy.
bash scripts/ensure_env.sh hf,mlflow,wandb,float8,docs,hf-trainer,search,plots,ft,ray,k8s,lint
# First, and failing fast: the lint, the format and the types, each checking what pyproject.toml names
# ([tool.ruff], [tool.mypy]). Seconds with mypy's cache (.mypy_cache); its first run takes about a minute.
echo "ruff check, ruff format --check, mypy..." >&2
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy
if [ "${1:-}" = "--quick" ]; then
    shift
    exec .venv/bin/python -m pytest -q -m "not slow" --durations=10 "$@"
fi
# The full run in two worker processes, each taking whole test files (pytest-xdist's loadfile: a file's fixtures
# are made once): with the ranks forked from a preloaded server (tests/conftest.py run_ranks) one process kept
# 1.35 of the 2 cores busy, and the suite took 24 min 26 s there against 20 min 45 s in two. TEST_WORKERS=0 runs
# every test in pytest's own process, one after the other (as the quick tier does).
workers=${TEST_WORKERS:-2}
if [ "$workers" = "0" ]; then
    exec .venv/bin/python -m pytest -q --durations=15 "$@"
fi
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --durations=15 "$@"
