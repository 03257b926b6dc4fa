#!/usr/bin/env bash
# N cooperating JAX processes on this machine, each with its own simulated CPU devices:
#   scripts/launch_local.sh 2 4 distillax train --config distillax/configs/lm.py:tiny --workdir runs/mp
# (2 processes x 4 devices = one 8-device mesh). All children are killed if one fails.
set -euo pipefail
n=${1:?number of processes}; d=${2:?devices per process}; shift 2
cd "$(dirname "$0")/.."
exec .venv/bin/python -m distillax.launch_local -n "$n" --devices_per_process "$d" -- "$@"
