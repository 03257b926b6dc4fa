"""`plan --target`: the process environment a deviceless compile needs, set before anything
imports JAX (as --devices is). Standard library only.

- JAX_PLATFORMS=cpu: the host computes on CPU; the target's devices are compile-only, and JAX
  must not try to open a TPU or GPU backend of its own.
- libtpu asks no cloud metadata server (TPU_SKIP_MDS_QUERY), looks for no TPU workers
  (TPU_WORKER_HOSTNAMES) and takes this host for one host (TPU_HOST_BOUNDS; else it prints
  "Failed to find host bounds for accelerator type"): off a TPU VM all three only print errors.
  The target's own hosts are the compile's (chips_per_host_bounds, framework/targets.py): the
  compiled programs of v5e:2x2 and a two-slice v5p:4x4x4 are the same text with and without. It also takes a lock file per
  process, which a second compile (or a test worker) would wait on and then fail with "Internal
  error when accessing libtpu multi-process lockfile": compile-only devices own no chip, so
  several processes may load it (ALLOW_MULTIPLE_LIBTPU_LOAD).
- A GPU target finds the CUDA plugin in the folder `make test` installs it into, `<venv>/aot-gpu`
  (or $DISTILLAX_AOT_GPU_PATH), kept off the default import path because the plugin logs "Could
  not find cuda drivers" at every `import jax` on a machine without a GPU. A plugin installed
  with `pip install 'distillax[aot-gpu]'` is found where pip put it.
"""

from __future__ import annotations

import os
import sys

GPU_PLUGIN_DIR_ENV = "DISTILLAX_AOT_GPU_PATH"


def gpu_plugin_dir() -> str:
  return os.environ.get(GPU_PLUGIN_DIR_ENV) or os.path.join(sys.prefix, "aot-gpu")


def prepare_target_environment(target: str) -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  folder = gpu_plugin_dir()
  if target.strip().lower().startswith("gpu:") and os.path.isdir(folder) and (
      folder not in sys.path):
    sys.path.insert(0, folder)
