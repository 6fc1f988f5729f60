#!/usr/bin/env bash
# Create .venv with requirements.txt installed, unless it is already there and up to date.
# Used by README's two commands and by .ci/run, so all three set up the same way.
#   bash scripts/ensure_env.sh        # the framework
#   bash scripts/ensure_env.sh hf     # and pyproject.toml's optional extras named (comma-separated), as the tests do
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}

python_bin=${PYTHON:-}
if [ -z "$python_bin" ]; then
    for candidate in python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1; then python_bin=$candidate; break; fi
    done
fi
[ -n "$python_bin" ] || { echo "error: no python3 found; install Python 3.11" >&2; exit 2; }

# The stamp records which requirements.txt and pyproject.toml the environment was built from; the extras'
# stamp, which extras were added on top of that build (a plain run after the tests needs no rebuild).
stamp=.venv/.requirements.sha256
wanted=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if ! { [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; }; then
    echo "setting up .venv (torch, torchvision, tensorboard, tqdm, pytest)..." >&2
    "$python_bin" -m venv .venv
    # pip's log goes to a file (this machine's pip config adds pages of warnings); shown only if it fails.
    if ! .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt \
            > .venv/pip-install.log 2>&1; then
        cat .venv/pip-install.log >&2
        echo "error: installing requirements.txt failed (log above, also in .venv/pip-install.log)" >&2
        exit 1
    fi
    # The framework itself, editable: `from train_multi_gpu import ...` and `multigpu-train` work from any folder.
    if ! .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e . \
            >> .venv/pip-install.log 2>&1; then
        tail -20 .venv/pip-install.log >&2
        echo "error: installing this checkout into .venv failed (log in .venv/pip-install.log)" >&2
        exit 1
    fi
    echo "$wanted" > "$stamp"
fi
[ -n "$extras" ] || exit 0
extras_stamp=.venv/.extras.sha256
wanted_extras=$(echo "$wanted $extras" | sha256sum | cut -d' ' -f1)
[ "$(cat "$extras_stamp" 2>/dev/null)" = "$wanted_extras" ] && exit 0
echo "adding the extras [$extras] to .venv..." >&2
# The extras without their bytecode compiled at install (Ray, transformers, MLflow, W&B, the docs' site: most of
# the set-up's time): a process compiles what it imports, and keeps it unless PYTHONDONTWRITEBYTECODE is set
# (scripts/run_tests.sh unsets it). The framework's own requirements above stay compiled for every run.
if ! .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile --no-build-isolation \
        -e ".[$extras]" >> .venv/pip-install.log 2>&1; then
    tail -20 .venv/pip-install.log >&2
    echo "error: installing the extras [$extras] into .venv failed (log in .venv/pip-install.log)" >&2
    exit 1
fi
echo "$wanted_extras" > "$extras_stamp"
