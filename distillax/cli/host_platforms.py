"""Which of JAX's platforms a command lets JAX start, decided before anything starts one.

With libtpu installed (the `aot` extra, for `plan --target tpu:...`) and JAX_PLATFORMS unset,
JAX tries its TPU backend on every host. Without a TPU that attempt fails quietly as far as JAX
is concerned, but libtpu first prints its own lines to stderr ("Failed to find host bounds for
accelerator type", "Logging before InitGoogle()", "INVALID_ARGUMENT ... TPU_WORKER_HOSTNAMES")
on every command. The CUDA plugin is kept off the import path for the same reason (Makefile's
AOT_GPU, target_env.py); libtpu cannot be, since a pip install puts it beside JAX.

So, when the user left JAX_PLATFORMS unset and the host has no TPU device by JAX's own test
(`jax._src.hardware_utils`: a Google TPU on the PCI bus; the same test that makes JAX set
'tpu,cpu' on a Cloud TPU VM at import), nor a TPU device node (/dev/accel*, /dev/vfio/<n>),
nor a GPU JAX would start (an NVIDIA device node, AMD's /dev/kfd), JAX could only run on the
CPU: the command asks for 'cpu' and libtpu is never loaded. A TPU host keeps JAX's choice (its
chip); `plan --target` still loads libtpu for its compile-only devices (target_env.py).
"""

from __future__ import annotations

import glob
import importlib.util
import os


def _libtpu_installed() -> bool:
  return bool(os.environ.get("TPU_LIBRARY_PATH")) or importlib.util.find_spec("libtpu") is not None


def _tpu_device_nodes() -> bool:
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _gpu_present(hardware_utils) -> bool:
  return hardware_utils.has_visible_nvidia_gpu() or os.path.exists("/dev/kfd")


def cpu_only_platforms() -> str | None:
  """'cpu' when JAX, left to itself, would try libtpu on a host that has no TPU (and no GPU
  either); None when JAX's own choice stands (JAX_PLATFORMS set, no libtpu, or a TPU or GPU
  present). Imports JAX, starting no backend: call it once --devices reached XLA_FLAGS."""
  if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_FORCE_TPU_INIT") is not None:
    return None
  if not _libtpu_installed():
    return None
  from jax._src import hardware_utils  # JAX's own test of the host, as its TPU set-up uses
  if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0 or _tpu_device_nodes():
    return None
  return None if _gpu_present(hardware_utils) else "cpu"


def skip_absent_tpu() -> None:
  """Keeps libtpu's start-up lines off a host without a TPU (cpu_only_platforms): for this
  process (JAX has read its environment already) and for the processes it starts."""
  platforms = cpu_only_platforms()
  if platforms:
    import jax
    os.environ["JAX_PLATFORMS"] = platforms
    jax.config.update("jax_platforms", platforms)
