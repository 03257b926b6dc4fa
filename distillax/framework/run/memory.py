"""Whether the compiled step fits the memory it is about to run in, asked before its first call.

Running out of memory inside the step is a 44-line JaxRuntimeError after the whole start (issue
48: a Llama 3.1 8B teacher on a 23 GB host: 13 GiB of arguments plus 26.8 GiB of temporaries).
The compiled step says per device what it needs (XLA's memory analysis); the models, which are
its arguments, are already in memory when this is asked. What must still fit is the rest: the
temporaries and the outputs that do not reuse an argument's buffer (donation aliases the
state). Simulated CPU devices share the host's memory, so their needs add up; an accelerator's
are its own.

Free memory is the kernel's MemAvailable (and a cgroup's limit, where one is lower) on the CPU,
and the device's limit less what it holds elsewhere; a platform that reports neither is not
checked.
"""

from __future__ import annotations

from typing import Mapping

import jax

from distillax import partitioning as pt
from distillax.errors import UserError


def _meminfo_available() -> float | None:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return float(line.split()[1]) * 1024
  except OSError:
    return None
  return None


def _cgroup_available() -> float | None:
  """What a cgroup v2 memory limit leaves (None without one)."""
  try:
    with open("/sys/fs/cgroup/memory.max") as f:
      limit = f.read().strip()
    with open("/sys/fs/cgroup/memory.current") as f:
      current = float(f.read().strip())
  except (OSError, ValueError):
    return None
  return None if limit == "max" else float(limit) - current


def free_bytes(device) -> tuple[float, int] | None:
  """(bytes free for a step on `device`'s memory, how many local devices share that memory);
  None where the platform does not say."""
  if device.platform == "cpu":
    figures = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    shared = sum(1 for d in jax.local_devices() if d.platform == "cpu")
    return (min(figures), shared) if figures else None
  try:
    stats = device.memory_stats() or {}
  except Exception:  # noqa: BLE001 - not every backend implements it
    return None
  if "bytes_limit" not in stats:
    return None
  return float(stats["bytes_limit"]) - float(stats.get("bytes_in_use", 0)), 1


def shortfall(stats: Mapping[str, float], free: float, devices: int) -> str | None:
  """Why a compiled step with `stats` (per device, compiled_stats's keys) does not fit `free`
  bytes shared by `devices` devices whose arguments are already in memory; None when it fits."""
  fmt = pt.shard.format_bytes
  temps = float(stats.get("temp_size_in_bytes", 0))
  outputs = max(float(stats.get("output_size_in_bytes", 0))
                - float(stats.get("alias_size_in_bytes", 0)), 0.0)
  need = (temps + outputs) * devices
  if need <= free:
    return None
  args = float(stats.get("argument_size_in_bytes", 0))
  shared = f"; {devices} devices share this host's memory" if devices > 1 else ""
  return (f"the compiled step needs {fmt(temps)} of temporaries"
          + (f" and {fmt(outputs)} of new outputs" if outputs else "")
          + f" per device beside its {fmt(args)} of arguments{shared}: {fmt(need)} more than "
          f"the models already take, but {fmt(max(free, 0.0))} is free; lower train.batch_size "
          f"or train.seq_len (train.accum_steps keeps the batch), use a smaller teacher or "
          f"student, or shard over more devices (mesh, partitioning.strategy)")


def check_step_fits(stats: Mapping[str, float], device=None) -> None:
  """Refuses, in one line naming the figures, a compiled step that cannot run in the memory
  left on `device` (the first local one by default); nothing when a figure is missing."""
  if not stats:
    return
  found = free_bytes(device if device is not None else jax.local_devices()[0])
  if found is None:
    return
  problem = shortfall(stats, *found)
  if problem is not None:
    raise UserError(problem)
