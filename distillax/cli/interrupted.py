"""What a command Ctrl-C ended says, and its exit status (docs/guides/running-jobs.md, "Exit
status"): rerunning resumes only where something was saved.

Between a train run's steps Ctrl-C saves the step (framework/run/preemption.py) and the command
exits with STOPPED_EXIT_CODE. Anywhere else (start-up, compiles, `plan`, `export`, ...) the
command ends at once: with STOPPED_EXIT_CODE and "rerun the same command to resume" when its
workdir holds a checkpoint to resume from, else with INTERRUPTED_EXIT_CODE and no such advice
(`plan`'s 3 is DOES NOT FIT; an interrupted plan must not read as one). Reads directory names
only: no JAX.
"""

from __future__ import annotations

import os

from distillax.interrupts import INTERRUPTED_EXIT_CODE, STOPPED_EXIT_CODE

_RESUMABLE = ("train",)  # commands whose workdir holds checkpoints a rerun resumes from


def saved_step(workdir: str | None) -> int | None:
  """The newest step under <workdir>/checkpoints (orbax names each step's folder by its
  number), None when there is none."""
  if not workdir:
    return None
  try:
    names = os.listdir(os.path.join(workdir, "checkpoints"))
  except OSError:
    return None
  steps = [int(n) for n in names if n.isdigit()]
  return max(steps) if steps else None


def interrupted(command: str | None, workdir: str | None) -> tuple[str, int]:
  """(the line, the exit status) of `command` interrupted by Ctrl-C outside a run's steps."""
  name = f"distillax{' ' + command if command else ''}"
  if command == "demo":  # a job of jobs: its finished stages are kept, the rest resume
    return f"{name}: interrupted; rerun the same command to resume", STOPPED_EXIT_CODE
  step = saved_step(workdir) if command in _RESUMABLE else None
  if step is not None:
    return (f"{name}: interrupted; rerun the same command to resume from step {step}",
            STOPPED_EXIT_CODE)
  if command in _RESUMABLE:
    return f"{name}: interrupted before its first step; nothing was saved", INTERRUPTED_EXIT_CODE
  return f"{name}: interrupted", INTERRUPTED_EXIT_CODE
