#!/usr/bin/env bash
# Install what the multi-host tests (tests/multihost/) need: iproute2 for network namespaces (fake hosts), and
# SLURM (Debian's slurm-wlm) with munge for a throw-away cluster on this machine. Idempotent; runs as root
# (CI and the dev boxes do). Without root, or where apt-get cannot run, it says so and the tests skip with
# the reason.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if [ "$(id -u)" != 0 ]; then
    echo "tests/multihost/INSTALL.sh: not root; the multihost tests will skip" >&2
    exit 0
fi
missing=()
command -v ip >/dev/null || missing+=(iproute2)
for bin in slurmctld slurmd srun munged; do
    command -v "$bin" >/dev/null || { missing+=(slurm-wlm munge); break; }
done
if [ ${#missing[@]} -gt 0 ]; then
    log=$(mktemp)
    apt-get update -qq -o DPkg::Lock::Timeout=300 >"$log" 2>&1 || true
    if ! apt-get install -y -qq -o DPkg::Lock::Timeout=300 "${missing[@]}" >>"$log" 2>&1; then
        echo "tests/multihost/INSTALL.sh: apt-get install ${missing[*]} failed; its last lines:" >&2
        tail -n 20 "$log" >&2
        rm -f "$log"
        exit 1
    fi
    rm -f "$log"
fi
for bin in ip slurmctld munged; do
    command -v "$bin" >/dev/null || { echo "tests/multihost/INSTALL.sh: $bin is still missing" >&2; exit 1; }
done
