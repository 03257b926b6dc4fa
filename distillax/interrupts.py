"""Ctrl-C from the moment a command starts until the loop's own handler takes over
(framework/run/preemption.py, which saves at the end of the step).

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be. When
that is inside a garbage-collection callback (JAX registers one), a weakref callback or a
`__del__`, Python prints "Exception ignored" and carries on: the interrupt is lost, and a
Ctrl-C at the start of `distillax train` used to let the run train to its end (issue 48). The
handler here raises the same KeyboardInterrupt and also records it, so `check()` between the
phases of a start raises it again where it cannot be lost, and the loop's guard, once
installed, stops at its first step (saving it) if one is still pending.

Standard library only: it is installed before anything imports JAX.
"""

from __future__ import annotations

import signal
import sys
import threading

# The exit status of a command a signal stopped (Ctrl-C, SIGTERM) with something saved:
# rerunning it resumes.
STOPPED_EXIT_CODE = 3
# The exit status of a command Ctrl-C ended with nothing to resume (128 + SIGINT, what a shell
# reports for a program SIGINT killed): never 3, which `plan` uses for DOES NOT FIT.
INTERRUPTED_EXIT_CODE = 130

_state = {"pending": False}


def _on_sigint(signum, frame) -> None:
  del signum, frame
  _state["pending"] = True
  raise KeyboardInterrupt


def _unraisable(info) -> None:
  """A KeyboardInterrupt Python could not raise (inside a gc callback or a __del__) is kept as
  pending, not printed as "Exception ignored in ..." lines; anything else as Python prints it."""
  if info.exc_type is KeyboardInterrupt and _state["pending"]:
    return
  sys.__unraisablehook__(info)


def install():
  """SIGINT raises KeyboardInterrupt and is remembered (main thread only: Python installs
  handlers there); returns the handler it replaced, for `restore`."""
  if threading.current_thread() is not threading.main_thread():
    return None
  sys.unraisablehook = _unraisable
  return signal.signal(signal.SIGINT, _on_sigint)


def restore(previous) -> None:
  """Puts back the handler `install` replaced (a command run inside another program)."""
  if previous is not None and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, previous)
    if sys.unraisablehook is _unraisable:
      sys.unraisablehook = sys.__unraisablehook__


def pending() -> bool:
  """A Ctrl-C arrived since `install` (or the last `clear`)."""
  return _state["pending"]


def clear() -> None:
  _state["pending"] = False


def check() -> None:
  """Raises KeyboardInterrupt when a Ctrl-C arrived, also one whose own exception was lost."""
  if _state["pending"]:
    raise KeyboardInterrupt


def leave(code: int) -> None:
  """Ends an interrupted command with `code` without the interpreter's teardown, which waits
  for the background threads still running (a step's XLA compile, say) and has crashed while
  they ran (issue 48: exit -11 after Ctrl-C during a compile). Returns when nothing was
  interrupted."""
  if not pending():
    return
  import os
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
