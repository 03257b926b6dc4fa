#!/usr/bin/env bash
# Downloads the wheels scripts/accelerator_run.sh carries (scripts/accelerator_wheels.txt) into
# DIR (default .whl), for CPython 3.11 on manylinux x86_64, without their dependencies:
#   scripts/accelerator_wheels.sh [DIR]        (or: make accelerator-wheels)
# PYTHON_VERSION=3.12 or PLATFORM_TAGS="manylinux_2_28_aarch64 ..." retarget it.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${PYTHON:-python3}
tags=${PLATFORM_TAGS:-manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64}
mkdir -p "$dir"
rm -f "$dir"/*.whl  # one version of each: two of one name stop pip's install there
platforms=()
for t in $tags; do platforms+=(--platform "$t"); done
mapfile -t wanted < <(grep -v '^\s*#' scripts/accelerator_wheels.txt | grep -v '^\s*$')
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.11}" \
  --implementation cp "${platforms[@]}" -d "$dir" "${wanted[@]}" 2>&1 | grep -v "is ignored" || true
count=$(ls "$dir"/*.whl 2>/dev/null | wc -l)
if [ "$count" -ne "${#wanted[@]}" ]; then
  echo "accelerator_wheels.sh: got $count wheels in $dir for ${#wanted[@]} requirements" >&2
  exit 1
fi
du -ch "$dir"/*.whl | tail -1 | sed "s|total|in $dir ($count wheels; the device carry limit is 64 MiB)|"
