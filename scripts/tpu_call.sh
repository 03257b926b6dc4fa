#!/usr/bin/env bash
# On a lent TPU (the device tool, which carries .whl/ from `make accelerator-wheels`): the wheels
# into /tmp/site (after the image's own JAX on PYTHONPATH), then the command given, its output
# kept in $OUT/log.txt (libtpu's INFO/WARNING lines left out: C++ glog lines, with microseconds
# and a thread id; Python's absl lines, distillax's "step 1 at ..." and JAX_LOG_COMPILES's among
# them, stay).
#   scripts/tpu_call.sh python3 benchmarks/accelerator.py --expect-tpu
set -uo pipefail
cd "$(dirname "$0")/.."
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site "${ACCEL_WHEELS:-.whl}"/*.whl >/dev/null 2>&1 || { echo "wheels failed"; exit 2; }
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD" PYTHONUNBUFFERED=1
"$@" 2>&1 | grep --line-buffered -v -E "^(W|I)[0-9]{4} [0-9:]+\.[0-9]{6} +[0-9]+ |^=== Source|libtpu_init_utils" | tee -a "${OUT:-/tmp}/log.txt"
