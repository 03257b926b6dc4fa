"""What `distillax train` says when a rerun changes a run's length: raising `train.steps` of a
run (finished or stopped) resumes it, and the learning-rate schedule, which decays over
`train.steps`, is recomputed over the new length. The resumed steps then follow a schedule the
earlier ones did not: the rate jumps back up from where the old decay had taken it. That is the
documented behaviour (docs/guides/running-jobs.md); this line makes it visible at start.
Imported only when `train` runs (it reads the workdir through trainers/, which imports JAX).
"""

from __future__ import annotations

import json
import os


def _stored_steps(workdir: str) -> int | None:
  """train.steps of the run in `workdir` as its config.json records it; None for no run."""
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      steps = json.load(f)["train"]["steps"]
  except (OSError, ValueError, KeyError, TypeError):
    return None
  return steps if isinstance(steps, int) else None


def schedule_note(workdir: str, config) -> str | None:
  """One line when this config resumes the run in `workdir` with another train.steps and a
  schedule that depends on it; None otherwise (a new run, the same length, a constant rate,
  or a run already past the new length: it is finished)."""
  from distillax.errors import UserError
  from distillax.framework.optim import make_schedule
  from distillax.trainers.workdir import check_workdir
  old, new = _stored_steps(workdir), int(config.train.steps)
  opt = config.optimizer
  if old is None or old == new or opt.get("schedule", "constant") == "constant":
    return None
  try:
    state = check_workdir(workdir, config)  # reads only; another job's workdir is refused later
  except UserError:
    return None
  if state.finished:
    return None
  at = (state.summary or {}).get("step")
  line = (f"train.steps={new} resumes this workdir's run of {old} steps with the learning-rate "
          f"schedule ({opt.schedule}) recomputed over {new} steps")
  if not isinstance(at, int) or at <= 0:
    return line
  before, now = (float(make_schedule(opt, n)(at)) for n in (old, new))
  return (f"{line}: at step {at} the rate is {now:.3g}, where the {old}-step schedule had "
          f"{before:.3g}")
