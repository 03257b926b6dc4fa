"""A step compiled ahead of time, in a background thread, and waited for where it is first used.

Lowering (tracing the step into a program) holds the GIL; XLA's compile releases it. So the
backends lower in the caller's thread and hand the compile to a worker thread, and the trainer
creates its models (their own compiles and runs) while the step compiles. Why: on a TPU v5e the
KD step of the Qwen3 pair (configs/distill_qwen3.py) compiles in 21-28 s and creating its two
models took 30-34 s each; one after the other they were most of the 115 s to the first step.

Whatever reads the compiled step (a call, the executable, its memory and FLOPs figures) waits for
the compile; it is the one program that runs, compiled once. A compile error (the compiler
running out of memory, say) is raised there, as the compile's own exception.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable, Mapping

# A few steps may compile side by side (a QAT run's engines before and after its start step).
_WORKERS = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                 thread_name_prefix="distillax-compile")
_PENDING: set[concurrent.futures.Future] = set()
_PENDING_LOCK = threading.Lock()


def compiled_stats(compiled) -> dict[str, float]:
  """Per-device memory (bytes) and FLOPs of a compiled executable, where XLA reports them."""
  stats: dict[str, float] = {}
  try:
    mem = compiled.memory_analysis()
    if mem is not None:
      for key in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                  "alias_size_in_bytes", "generated_code_size_in_bytes"):
        stats[key] = float(getattr(mem, key, 0) or 0)
  except Exception:  # noqa: BLE001 - not every backend implements it
    pass
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if cost and "flops" in cost:
      stats["flops"] = float(cost["flops"])
  except Exception:  # noqa: BLE001
    pass
  return stats


def wait_for_pending() -> None:
  """Returns once no step is compiling in the background (errors stay with their steps): what
  must happen before JAX's compilation cache is switched to another directory."""
  with _PENDING_LOCK:
    pending = list(_PENDING)
  concurrent.futures.wait(pending)


def in_background(fn: Callable[[], Any]) -> concurrent.futures.Future:
  """`fn()` on the compile workers, waited for by `wait_for_pending` like a step's compile (the
  eval's programs, compiled ahead of the first eval: framework/eval_programs.py)."""
  future = _WORKERS.submit(fn)
  _track(future)
  return future


def _track(future: concurrent.futures.Future) -> None:
  with _PENDING_LOCK:
    _PENDING.add(future)

  def done(f):
    with _PENDING_LOCK:
      _PENDING.discard(f)
  future.add_done_callback(done)


class AotStep:
  """`lowered.compile()`, started now in a worker thread (or done here, `background=False`, which
  raises a compile error at once).

  `on_ready(stats)` runs once, in the thread that first waits for the result (the backends log
  the compiled step's figures there, so the line comes from the thread that runs the job).
  Calling an AotStep calls the compiled executable.
  """

  def __init__(self, lowered, *, lower_seconds: float = 0.0, background: bool = True,
               on_ready: Callable[[Mapping[str, float]], Any] | None = None):
    self.lower_seconds = lower_seconds
    self._on_ready = on_ready
    self._lock = threading.Lock()
    self._announced = False
    if background:
      self._future = _WORKERS.submit(self._compile, lowered)
      _track(self._future)
    else:  # compiled here: a compile error is raised here
      self._future = concurrent.futures.Future()
      self._future.set_result(self._compile(lowered))

  @staticmethod
  def _compile(lowered):
    start = time.perf_counter()
    executable = lowered.compile()
    seconds = time.perf_counter() - start
    return executable, compiled_stats(executable), seconds

  def _result(self):
    if not self._future.done():
      logging.debug("waiting for the step's compile")
    executable, stats, seconds = self._future.result()
    if not self._announced:
      with self._lock:
        if not self._announced:
          self._announced = True
          if self._on_ready is not None:
            self._on_ready(stats)
    return executable, stats, seconds

  def done(self) -> bool:
    """Whether the compile has finished (without waiting)."""
    return self._future.done()

  @property
  def executable(self):
    return self._result()[0]

  @property
  def stats(self) -> dict[str, float]:
    return self._result()[1]

  @property
  def compile_seconds(self) -> float:
    """XLA's compile alone, in its thread (it overlaps whatever the caller did meanwhile)."""
    return self._result()[2]

  def __call__(self, *args):
    return self._result()[0](*args)
