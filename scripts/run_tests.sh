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
# ([hf-trainer]) and TRL's SFTTrainer ([trl]), the sweep's --search with its plots ([search], [plots]),
# --fault-tolerance ([ft]), --ray-workers ([ray]), the TrainJob of --k8s read through Kubeflow Trainer's API model
# ([k8s]) and --lora-r, --qlora ([lora]); [lint] brings ruff and mypy.
bash scripts/ensure_env.sh hf,mlflow,wandb,float8,docs,hf-trainer,trl,search,plots,ft,ray,k8s,lora,lint
# Bytecode kept once compiled, whatever this machine's default: the extras are installed without it
# (scripts/ensure_env.sh), and the tests start hundreds of processes that import them.
unset PYTHONDONTWRITEBYTECODE
# First, and failing fast: the lint, the format and the types, each checking what pyproject.toml names
# ([tool.ruff], [tool.mypy]). Seconds with mypy's cache (.mypy_cache); its first run takes about a minute.
echo "ruff check, ruff format --check, mypy..." >&2
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy
# Both tiers run in worker processes, each taking whole test files (pytest-xdist's loadfile: a file's fixtures
# are made once). Three for the full run on two cores: its tests wait on processes, servers and restarts a good
# part of the time (with two, the cores were busy 85% of it), and the third fills those waits: 22 min 18 s
# against 27 min 6 s in two, on the same machine and tests. Four took 20 min 17 s of pytest, three 21 min 20 s
# (fresh clones of a quiet machine, 2026-11-29): three, the load CI has passed under. The quick tier's tests
# are mostly in-process: two.
# TEST_WORKERS=0 runs every test in pytest's own process, one after the other.
tier=(--durations=15)
workers=${TEST_WORKERS:-3}
if [ "${1:-}" = "--quick" ]; then
    shift
    tier=(-m "not slow" --durations=10)
    workers=${TEST_WORKERS:-2}
fi
if [ "$workers" = "0" ]; then
    exec .venv/bin/python -m pytest -q "${tier[@]}" "$@"
fi
# --no-loadscope-reorder: pytest-xdist would otherwise start the files with the most tests first, not the
# heaviest first (tests/conftest.py HEAVIEST_FILES), and a worker that took the docs' ten minutes last ran on alone.
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder "${tier[@]}" "$@"
