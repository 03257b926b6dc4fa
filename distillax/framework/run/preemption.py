"""Preemption: turn SIGTERM (and Ctrl-C) into "save at this step and exit cleanly", agreed by
every process.

The loop asks `guard.should_stop(step)` once per step; when it turns True the loop force-saves a
checkpoint at that step and returns, and the next run resumes there. The command then exits with
STOPPED_EXIT_CODE. Ctrl-C (SIGINT) is handled like SIGTERM; the first one puts SIGINT back to
the operating system's default, so a second Ctrl-C ends the process at once (even while Python
waits inside a long device call), without saving.

Where the notice comes from:
- One process: a Python SIGTERM handler sets a flag (the process is not killed).
- Several processes with JAX's preemption service (on by default after
  `jax.distributed.initialize`): JAX's runtime already listens for SIGTERM and runs a sync
  protocol that picks one step at which *every* process sees
  `reached_preemption_sync_point(step)` True. A Python SIGTERM handler would replace the
  runtime's, so none is installed and the sync point alone decides; Ctrl-C is forwarded to it as
  a SIGTERM to the own process.
- Several processes without that service: the Python handler sets the local flag and the
  processes OR their flags with an allgather every `multihost_check_every` steps, so all stop at
  the same step (each must call `should_stop` with the same steps).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Iterable

import jax
import numpy as np
from jax.experimental import multihost_utils

from distillax import interrupts

log = logging.getLogger(__name__)

# The exit status of a command whose run a signal stopped before its last step (saved; rerunning
# the same command resumes). 0 is a finished run, 2 a user error.
STOPPED_EXIT_CODE = interrupts.STOPPED_EXIT_CODE
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_INTERRUPT_NOTICE = (b"distillax: interrupted: saving a checkpoint at the end of this step, then "
                     b"stopping (Ctrl-C again aborts at once, without saving)\n")


def _preemption_service_active() -> bool:
  try:
    from jax._src import distributed  # the public API offers no "is it initialised?" query
  except ImportError:
    return False
  state = distributed.global_state
  return state.client is not None and state.preemption_sync_manager is not None


class PreemptionGuard:
  """Install once before the loop; `close()` (or leaving the `with` block) restores the previous
  signal handlers."""

  def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS, *,
               multihost_check_every: int = 1):
    self._signals = tuple(signals)
    self._check_every = max(1, int(multihost_check_every))
    self._received = threading.Event()
    self._signal_name: str | None = None
    self._stop_step: int | None = None
    self._previous: dict[int, object] = {}
    self._multi = jax.process_count() > 1
    self._use_sync_point = self._multi and _preemption_service_active()
    # Under the preemption service the runtime owns SIGTERM.
    self._install([s for s in self._signals
                   if not (self._use_sync_point and s == signal.SIGTERM)])
    if signal.SIGINT in self._signals and interrupts.pending():
      # A Ctrl-C of the start whose KeyboardInterrupt was lost (distillax/interrupts.py).
      self._signal_name = "SIGINT"
      self._received.set()

  def _install(self, signals: list[int]) -> None:
    """Python runs handlers between bytecodes of the main thread: the process keeps running."""
    if not signals:
      return
    if threading.current_thread() is not threading.main_thread():
      log.warning("PreemptionGuard created off the main thread: Python can install signal "
                  "handlers only on the main thread, so %s will not be caught",
                  [signal.Signals(s).name for s in signals])
      return
    for sig in signals:
      self._previous[sig] = signal.signal(sig, self._on_signal)

  def _on_signal(self, signum, frame) -> None:
    del frame
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.SIG_DFL)  # the next Ctrl-C ends the process at once
      os.write(2, _INTERRUPT_NOTICE)
    self._signal_name = self._signal_name or signal.Signals(signum).name
    if self._use_sync_point:
      os.kill(os.getpid(), signal.SIGTERM)  # the runtime's notifier picks the common stop step
      return
    self._received.set()

  @property
  def received(self) -> bool:
    """This process got a preemption signal (or `request_stop`)."""
    return self._received.is_set()

  @property
  def stop_step(self) -> int | None:
    """The step at which `should_stop` first returned True."""
    return self._stop_step

  def request_stop(self) -> None:
    """Asks for a stop as a signal would (e.g. from a time limit).

    Under JAX's preemption service the stop step must come from its sync protocol, so this
    sends SIGTERM to the own process, which the runtime's notifier turns into a preemption.
    """
    if self._use_sync_point:
      os.kill(os.getpid(), signal.SIGTERM)
      return
    self._signal_name = self._signal_name or "request_stop"
    self._received.set()

  def should_stop(self, step: int) -> bool:
    """True once the run should save at `step` and exit; stays True afterwards."""
    if self._stop_step is not None:
      return True
    step = int(step)
    if self._use_sync_point:
      stop = bool(multihost_utils.reached_preemption_sync_point(step))
    elif self._multi:
      stop = False
      if step % self._check_every == 0:
        flags = multihost_utils.process_allgather(np.asarray(self.received, np.int32))
        stop = bool(np.any(flags))
    else:
      stop = self.received
    if stop:
      self._stop_step = step
      source = self._signal_name or ("JAX preemption sync point" if self._use_sync_point
                                     else "signal on another process")
      log.warning("preemption (%s): stopping at step %d; save a checkpoint and exit", source, step)
    return stop

  def close(self) -> None:
    """Puts back the handlers that were installed before this guard."""
    if self._previous and threading.current_thread() is threading.main_thread():
      for sig, previous in self._previous.items():
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
      self._previous = {}

  def __enter__(self) -> "PreemptionGuard":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
