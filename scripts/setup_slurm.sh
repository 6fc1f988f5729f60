#!/usr/bin/env bash
# Install Debian's Slurm and MUNGE for the single-node SLURM test (tests/slurm_cluster.py),
# unless they are already there. Best effort: without root or apt-get it says why and
# exits 0, and the SLURM tests skip with that reason.
set -euo pipefail

if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
    command -v munged >/dev/null; then
    exit 0
fi
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "setup_slurm.sh: Slurm is not installed and cannot be installed here (needs root and apt-get);" \
        "the SLURM tests will skip" >&2
    exit 0
fi
echo "setup_slurm.sh: installing slurm-wlm and munge (Debian packages)..." >&2
log=$(mktemp)
# The daemons are started by the test with its own configuration, never by the package scripts.
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurm-wlm munge; } >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "setup_slurm.sh: installing slurm-wlm and munge failed (above); the SLURM tests will skip" >&2
fi
rm -f "$log"
