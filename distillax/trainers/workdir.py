"""The workdir contract (DESIGN.md, "Workdir contract"): what a run keeps where, and the only
code that creates or writes its top-level files.

    <workdir>/config.json     the resolved config, written only after every check passed
    <workdir>/metrics.jsonl   one JSON object per logged step (framework/writers.py)
    <workdir>/summary.json    final metrics of the run, {"finished": bool, ...}
    <workdir>/checkpoints/    orbax checkpoints
    <workdir>/tensorboard/    TensorBoard event files
"""

from __future__ import annotations

import json
import os

from distillax.errors import UserError
from distillax.framework.checkpoint import Checkpointer

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "checkpoints"


def _not_writable(workdir: str, e: OSError) -> UserError:
  return UserError(f"workdir {workdir} is not writable ({e.strerror or e}); pass --workdir "
                   f"pointing to a directory you can write")


def open_checkpointer(workdir: str, checkpoint_cfg) -> Checkpointer:
  """The run's checkpoint manager (`checkpoint` section); keeps the best by eval loss too."""
  c = checkpoint_cfg
  try:
    return Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), every_steps=int(c.every_steps),
                        keep_last=int(c.keep), keep_best=int(c.keep_best),
                        best_metric="eval_loss", async_save=bool(c.async_save))
  except OSError as e:
    raise _not_writable(workdir, e) from None


def prepare_workdir(workdir: str, config, *, primary: bool) -> None:
  """Creates the workdir and writes config.json (atomically); call it only once the config,
  the data and the compiled step have passed every check."""
  try:
    os.makedirs(workdir, exist_ok=True)
    if not os.access(workdir, os.W_OK):
      raise PermissionError(13, "Permission denied")
  except OSError as e:
    raise _not_writable(workdir, e) from None
  if primary:
    tmp = os.path.join(workdir, CONFIG_FILE + ".tmp")
    with open(tmp, "w") as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    os.replace(tmp, os.path.join(workdir, CONFIG_FILE))


def write_summary(workdir: str, summary: dict) -> None:
  with open(os.path.join(workdir, SUMMARY_FILE), "w") as f:
    json.dump(summary, f, indent=2, sort_keys=True)


def read_summary(workdir: str) -> dict | None:
  """The run's summary.json, or None when the run never finished a session."""
  path = os.path.join(workdir, SUMMARY_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)
