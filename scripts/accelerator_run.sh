#!/usr/bin/env bash
# benchmarks/accelerator.py on a bare GPU/TPU machine: its own Python and JAX, no pip index.
#   scripts/accelerator_run.sh --expect-gpu [accelerator.py flags, e.g. --only train/]
# Before: `make accelerator-wheels` here (wheels into .whl/), then carry .whl with the repo.
# There: the carried wheels the image lacks (or has outside pyproject.toml's ranges) go into a
# fresh target folder (benchmarks/lib/accelerator_deps.py; pip --no-index or unpacking, never the
# network), which goes first on PYTHONPATH with the repo after it; the image's own JAX is used.
# One `timeout` (ACCEL_TIMEOUT_S, default 420 s) bounds the whole run. Results go to $OUT
# when set (the device tool's folder), else benchmarks/results: accelerator.json (rewritten
# after every row), accelerator.log and accelerator_deps.txt.
# Environment: PYTHON (default python3), ACCEL_TIMEOUT_S, ACCEL_WHEELS (default .whl),
# XLA_PYTHON_CLIENT_MEM_FRACTION.
set -uo pipefail
cd "$(dirname "$0")/.."
timeout_s=${ACCEL_TIMEOUT_S:-420}
if [ -z "${_ACCEL_RUN_TIMED:-}" ]; then  # re-run this script once, under the one timeout
  export _ACCEL_RUN_TIMED=1
  timeout -k 15 "$timeout_s" "$0" "$@"
  status=$?
  [ "$status" -eq 124 ] && echo "accelerator_run.sh: stopped at its ${timeout_s}s timeout" >&2
  exit "$status"
fi
py=${PYTHON:-python3}
results=${OUT:-benchmarks/results}
site=$(mktemp -d)/site
mkdir -p "$results"
"$py" benchmarks/lib/accelerator_deps.py --wheels "${ACCEL_WHEELS:-.whl}" --target "$site" \
  2>&1 | tee "$results/accelerator_deps.txt" || exit 2
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" benchmarks/accelerator.py --json "$results/accelerator.json" "$@" 2>&1 \
  | tee "$results/accelerator.log"
