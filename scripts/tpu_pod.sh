#!/usr/bin/env bash
# The same command on every host of a TPU pod slice; JAX detects the pod (no coordinator flags).
#   scripts/tpu_pod.sh my-tpu us-central2-b runs/llama8b distillax/configs/llama3_8b.py
# Multi-slice (several slices over DCN): add --config.mesh.dcn_data=<slices> so tensor
# parallelism stays inside a slice; mesh.data/mesh.model are then the per-slice sizes.
set -euo pipefail
tpu=${1:?TPU name}; zone=${2:?zone}; workdir=${3:?workdir (use a gs:// path or shared disk)}
config=${4:?config file}; shift 4
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "
  cd ~/distillax && .venv/bin/distillax train --config $config --workdir $workdir \
    --config.runtime.auto_detect=True $*"
