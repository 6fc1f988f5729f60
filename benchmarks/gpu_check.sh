#!/usr/bin/env bash
# The one command that proves the GPU path (docs/measured.md, "Measured on GPUs"):
#   bash benchmarks/gpu_check.sh [--cpu-dry-run [--jobs N]] [--output PATH] [--only ROW,...]
# Installs nothing from the network. It uses the torch it finds; the project's other requirements, when
# missing, come from the wheels carried in .whl/ beside the checkout, installed into a temporary folder
# on PYTHONPATH. Then it runs benchmarks/gpu_check.py with the same arguments.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The interpreter: $PYTHON if set, else the checkout's .venv, else python3 (as launch_multi_gpu.sh).
python_bin=${PYTHON:-}
if [ -z "$python_bin" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then python_bin=$repo/.venv/bin/python; else python_bin=python3; fi
fi
command -v "$python_bin" >/dev/null 2>&1 || { echo "gpu_check.sh: no Python found ($python_bin)" >&2; exit 2; }

# What the checks import (requirements.txt without the test tools).
modules=(torch torchvision tensorboard tqdm numpy)

missing_modules() {
    "$python_bin" -c 'import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "${modules[@]}"
}

# Carried wheels whose distribution is not installed; never torch or its CUDA libraries, which must
# be the ones built for this machine.
wheels_to_install() {
    local wheel name
    for wheel in "$repo"/.whl/*.whl; do
        [ -e "$wheel" ] || continue
        name=${wheel##*/}
        name=${name%%-*}
        case $name in torch | triton | nvidia_*) continue ;; esac
        "$python_bin" -c 'import importlib.metadata, sys; importlib.metadata.version(sys.argv[1])' "$name" \
            2>/dev/null || printf '%s\n' "$wheel"
    done
}

missing=$(missing_modules)
if [ -n "$missing" ] && [ -d "$repo/.whl" ]; then
    mapfile -t wheels < <(wheels_to_install)
    if [ "${#wheels[@]}" -gt 0 ]; then
        site=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")
        echo "gpu_check.sh: missing $missing; installing ${#wheels[@]} wheel(s) from .whl/ into $site" >&2
        "$python_bin" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$site" "${wheels[@]}"
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        missing=$(missing_modules)
    fi
fi
if [ -n "$missing" ]; then
    echo "gpu_check.sh: missing Python modules: $missing; install them, or carry their wheels in $repo/.whl/" >&2
    exit 2
fi

exec "$python_bin" "$repo/benchmarks/gpu_check.py" "$@"
