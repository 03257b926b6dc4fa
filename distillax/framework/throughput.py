"""Peak FLOP/s and HBM bandwidth per device, achieved TFLOP/s and MFU (model FLOPs utilisation).

Accelerator peaks come from a table of vendor figures (dense bf16 matmul, per chip) matched on
`device.device_kind`. A CPU has no meaningful datasheet figure, so its peak is measured once per
process with a dense fp32 matmul probe; the result is divided among the simulated host devices
that share those cores, so MFU over all devices still compares against the machine's real peak.
Anything else gets no peak: a warning, TFLOP/s only, and MFU left out.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

# Dense bf16 peak FLOP/s and HBM bandwidth (bytes/s) per chip (vendor figures; FLOP/s without
# structured sparsity). Matched in order against the lower-cased device_kind; the first entry
# whose every needle is present wins, so the more specific variants come first.
#   TPU v4  275 TFLOP/s, 1200 GB/s  cloud.google.com/tpu/docs/v4 ("275 teraflops" bf16 per chip)
#   TPU v5e 197 TFLOP/s, 819 GB/s   cloud.google.com/tpu/docs/v5e (device_kind "TPU v5 lite")
#   TPU v5p 459 TFLOP/s, 2765 GB/s  cloud.google.com/tpu/docs/v5p (device_kind "TPU v5" / "v5p")
#   TPU v6e 918 TFLOP/s, 1640 GB/s  cloud.google.com/tpu/docs/v6e (Trillium, "TPU v6 lite")
#   A100    312 TFLOP/s; 2039 GB/s SXM 80GB, 1935 GB/s PCIe 80GB, 1555 GB/s 40GB  NVIDIA A100
#           datasheet (bf16 tensor core, SXM and PCIe alike)
#   H100    989 TFLOP/s SXM, 756 PCIe, 835 NVL; 3.35 TB/s SXM, 2.0 PCIe, 3.9 NVL  NVIDIA H100
#           datasheet (1979/1513/1671 "with sparsity", halved for dense)
#   H200    989 TFLOP/s SXM, 835 NVL; 4.8 TB/s both  NVIDIA H200 datasheet (1979/1671 with
#           sparsity, halved)
_PEAK_TABLE: tuple[tuple[tuple[str, ...], float, float, str], ...] = (
    (("v6", "lite"), 918e12, 1640e9, "TPU v6e"),
    (("v6e",), 918e12, 1640e9, "TPU v6e"),
    (("v5", "lite"), 197e12, 819e9, "TPU v5e"),
    (("v5e",), 197e12, 819e9, "TPU v5e"),
    (("v5p",), 459e12, 2765e9, "TPU v5p"),
    (("tpu", "v5"), 459e12, 2765e9, "TPU v5p"),
    (("tpu", "v4"), 275e12, 1200e9, "TPU v4"),
    (("h200", "nvl"), 835e12, 4.8e12, "H200 NVL"),
    (("h200",), 989e12, 4.8e12, "H200 SXM"),
    (("h100", "pcie"), 756e12, 2.0e12, "H100 PCIe"),
    (("h100", "nvl"), 835e12, 3.9e12, "H100 NVL"),
    (("h100",), 989e12, 3.35e12, "H100 SXM"),
    (("a100", "80gb", "pcie"), 312e12, 1935e9, "A100 80GB PCIe"),
    (("a100", "80gb"), 312e12, 2039e9, "A100 80GB SXM"),
    (("a100",), 312e12, 1555e9, "A100 40GB"),
)

# Matmul sizes of the CPU probe: big enough to reach the BLAS kernel's steady rate, small enough
# that the whole probe (compile included) takes well under a second on two cores.
CPU_PROBE_SIZES = (256, 512, 1024)
CPU_PROBE_REPEATS = 5

_cpu_probe_lock = threading.Lock()
_cpu_probe_cache: dict[str, float] = {}
_warned_kinds: set[str] = set()


def _table_entry(device_kind: str):
  kind = device_kind.lower()
  for needles, peak, bandwidth, name in _PEAK_TABLE:
    if all(needle in kind for needle in needles):
      return peak, bandwidth, name
  return None


def table_peak(device_kind: str) -> tuple[float, str] | None:
  """(bf16 dense FLOP/s, name) from the table for a device_kind string, or None if unknown."""
  found = _table_entry(device_kind)
  return None if found is None else (found[0], found[2])


def table_hbm_bandwidth(device_kind: str) -> tuple[float, str] | None:
  """(HBM bytes/s, name) from the table for a device_kind string, or None if unknown."""
  found = _table_entry(device_kind)
  return None if found is None else (found[1], found[2])


# The probe's matmul: fp32 at full precision, so its rate is the host's dense fp32 matmul rate.
_matmul_fp32 = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))


def measure_cpu_matmul_flops(sizes=CPU_PROBE_SIZES, repeats: int = CPU_PROBE_REPEATS,
                             device: Any = None, *, clock: Callable[[], float] | None = None,
                             matmul: Callable[[Any, Any], Any] | None = None) -> float:
  """Best fp32 matmul FLOP/s over a few square sizes on one CPU device (uncached).

  An n x n matmul counts 2 n^3 FLOPs and is timed from its dispatch until its result is ready;
  the first call of each size (compilation, cold caches) is not timed. `clock` (default
  time.perf_counter) and `matmul` can be replaced so that this arithmetic is tested without
  reading a real clock.
  """
  device = device or jax.devices("cpu")[0]
  clock = clock or time.perf_counter
  matmul = matmul or _matmul_fp32
  best = 0.0
  rng = np.random.default_rng(0)
  for n in sizes:
    a = jax.device_put(rng.standard_normal((n, n), dtype=np.float32), device)
    b = jax.device_put(rng.standard_normal((n, n), dtype=np.float32), device)
    matmul(a, b).block_until_ready()  # compile and warm the caches
    for _ in range(repeats):
      start = clock()
      matmul(a, b).block_until_ready()
      best = max(best, 2.0 * n ** 3 / max(clock() - start, 1e-9))
  return best


def cpu_peak_flops() -> float:
  """The whole host's measured matmul FLOP/s, probed once per process."""
  with _cpu_probe_lock:
    if "peak" not in _cpu_probe_cache:
      _cpu_probe_cache["peak"] = measure_cpu_matmul_flops()
    return _cpu_probe_cache["peak"]


def peak_flops_per_device(device: Any = None) -> tuple[float | None, str]:
  """(peak FLOP/s of one device or None, where the figure comes from).

  TPUs and NVIDIA GPUs: the dense bf16 datasheet figure. CPU: the measured fp32 matmul peak of
  the host divided by the number of CPU devices this process simulates (they share the cores).
  Unknown accelerators: None with a warning, so callers report TFLOP/s without MFU.
  """
  device = device or jax.local_devices()[0]
  if device.platform == "cpu":
    host_peak = cpu_peak_flops()
    num_cpu_devices = max(1, len(jax.local_devices(backend="cpu")))
    source = f"cpu fp32 matmul probe: {host_peak / 1e9:.1f} GFLOP/s per host"
    if num_cpu_devices > 1:
      source += f", shared by {num_cpu_devices} host devices"
    return host_peak / num_cpu_devices, source
  found = table_peak(device.device_kind)
  if found is None:
    if device.device_kind not in _warned_kinds:
      _warned_kinds.add(device.device_kind)
      logging.warning("No peak FLOP/s known for device kind %r: reporting TFLOP/s without MFU.",
                      device.device_kind)
    return None, f"unknown device kind {device.device_kind!r}"
  peak, name = found
  return peak, f"{name} bf16 dense datasheet peak ({peak / 1e12:.0f} TFLOP/s)"


def hbm_bandwidth_per_device(device: Any = None) -> tuple[float | None, str]:
  """(datasheet HBM bandwidth of one device in bytes/s or None, where the figure comes from):
  what a memory-bound program (a decode step reads every weight and its KV cache) is held to.
  A CPU has no HBM and an unknown accelerator no figure: None, and no roofline."""
  device = device or jax.local_devices()[0]
  if device.platform == "cpu":
    return None, "cpu: no HBM bandwidth"
  found = table_hbm_bandwidth(device.device_kind)
  if found is None:
    return None, f"unknown device kind {device.device_kind!r}"
  bandwidth, name = found
  return bandwidth, f"{name} HBM datasheet bandwidth ({bandwidth / 1e9:.0f} GB/s)"


def tflops_per_device(model_flops_per_step: float, step_time_s: float, num_devices: int) -> float:
  """Achieved model TFLOP/s per device."""
  return model_flops_per_step / step_time_s / num_devices / 1e12


def mfu(model_flops_per_step: float, step_time_s: float, num_devices: int,
        peak: float | None) -> float | None:
  """Model FLOPs utilisation in [0, 1]: achieved FLOP/s over num_devices * peak (None if no peak)."""
  if peak is None or not peak > 0 or not step_time_s > 0:
    return None
  return model_flops_per_step / step_time_s / (num_devices * peak)


@dataclasses.dataclass(frozen=True)
class Throughput:
  """What one step processes, for turning a measured step time into rates.

  tokens_per_step and model_flops_per_step are global (all devices); peak_flops_per_device is
  from `peak_flops_per_device()` and may be None (then no MFU).
  """
  tokens_per_step: int
  model_flops_per_step: float
  num_devices: int
  peak_flops_per_device: float | None = None

  def rates(self, num_steps: int, seconds: float) -> dict[str, float]:
    """step_time_s, tokens_per_s, tflops_per_device and mfu (if a peak is known)."""
    if num_steps <= 0 or not seconds > 0 or not math.isfinite(seconds):
      return {}
    step_time = seconds / num_steps
    out = {
        "step_time_s": step_time,
        "tokens_per_s": self.tokens_per_step / step_time,
        "tflops_per_device": tflops_per_device(self.model_flops_per_step, step_time,
                                               self.num_devices),
    }
    utilisation = mfu(self.model_flops_per_step, step_time, self.num_devices,
                      self.peak_flops_per_device)
    if utilisation is not None:
      out["mfu"] = utilisation
    return out
