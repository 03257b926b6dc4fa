"""Where the time to a run's first step goes, said in one log line at that step.

A job marks the end of each phase of its start on its recipe's clock (the recipe: JAX's runtime
start, where a chip opens, then sources, mesh and tokenizer; the loop: checks, the step's
lowering, data, model creation, the wait for the step's compile, the memory check and the
workdir, metrics, the first batch and the first step); each phase is the time since the
previous mark, the first since the process started (imports, config, the distributed runtime).
Some work runs beside the phases and is said after them, with its own duration: the step's
compile (framework/step_program.py), and under the CLI the start of the devices, which runs
while the job's modules import (framework/run/runtime.py: its phase is then "waiting for the
devices", what was left of it when the recipe needed them).
"""

from __future__ import annotations

import os
import time

_CLOCK_TICKS = "SC_CLK_TCK"


def process_age() -> float | None:
  """Seconds since the OS started this process (Linux: /proc/self/stat against the boot-time
  clock), or None where that is not known."""
  try:
    with open("/proc/self/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    started = int(fields[19]) / os.sysconf(_CLOCK_TICKS)  # field 22: start time since boot
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started
  except (OSError, ValueError, IndexError, AttributeError):
    return None


class StartupClock:
  """Phases of a job's start, in order, each the time since the previous mark."""

  def __init__(self):
    self.phases: dict[str, float] = {}
    self._last: float | None = None
    self._origin: float | None = None  # perf_counter() reading at the process's start
    self.beside: dict[str, float] = {}  # what ran beside the phases -> its seconds

  def mark(self, phase: str) -> None:
    """`phase` ended now (adds to it when marked again)."""
    now = time.perf_counter()
    if self._last is None:
      age = process_age()
      self._origin = now - age if age is not None else now
      self._last = self._origin
    self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
    self._last = now

  def since_start(self) -> float:
    return 0.0 if self._origin is None else time.perf_counter() - self._origin

  def line(self, step: int, compile_seconds: float | None = None) -> str:
    """'step 1 at 27.4 s since the process started: imports, config and runtime 3.1 s, devices
    10.2 s, ...; the step compiled in 18.0 s beside them' (with `beside`: '...; the devices
    opened in 7.2 s and the step compiled in 18.0 s beside them')."""
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
    line = f"step {step} at {self.since_start():.1f} s since the process started: {parts}"
    beside = [f"{name} in {seconds:.1f} s" for name, seconds in self.beside.items()]
    if compile_seconds is not None:
      beside.append(f"the step compiled in {compile_seconds:.1f} s")
    if beside:
      line += f"; {' and '.join(beside)} beside them"
    return line
