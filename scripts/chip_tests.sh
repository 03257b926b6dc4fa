#!/usr/bin/env bash
# The tests whose claims depend on the hardware (splash attention, the MoE grouped matmul, the
# vocabulary chunk / slice engines and tokamax's fused loss, q4_0 rounding), in one process, with
# a pass/fail summary (and $OUT/chip_tests.json when OUT is set). scripts/chip_tests.py has the
# selection and why each is there.
#   scripts/tpu_call.sh scripts/chip_tests.sh --tpu    on a lent TPU (the real Mosaic kernels)
#   scripts/chip_tests.sh                              here: a dry run on CPU (Pallas interpret)
# PYTHON picks the interpreter (default: .venv/bin/python when there is one, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$py" -c "import pytest" 2>/dev/null; then  # the chip's image may lack it: carry its wheels
  echo "chip_tests.sh: $py has no pytest; carry pytest, pluggy and iniconfig wheels (e.g. pip" \
       "download --no-deps --only-binary=:all: -d .whl pytest==9.2.0 pluggy==1.7.0" \
       "iniconfig==2.3.1)" >&2
  exit 2
fi
exec "$py" scripts/chip_tests.py "$@"
