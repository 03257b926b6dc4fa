"""Where host-side metric rows go: metrics.jsonl, TensorBoard event files, the console.

Only process 0 writes (`create_writers` returns an empty writer elsewhere), so a multi-host run
produces one file of each kind. Every writer takes rows of `{name: float}` at an integer step.

Resuming: pass the restored step as `resume_step`. metrics.jsonl keeps its rows up to that step
and drops later ones (written after the last checkpoint by the run that died), and TensorBoard gets
a purge marker so its own reader hides those later events too. A resumed run therefore shows one
clean curve in both.

Rolling back: the rows of the abandoned trajectory move out of metrics.jsonl into
metrics.rolled_back.jsonl beside it, each marked `"rolled_back": true` (nothing is lost), and
metrics.jsonl keeps one history: the rows up to the step rolled back to, the rollback's own row
`{"step": N, "rolled_back_to": M, ...}`, then the rows of steps M+1.. run again. TensorBoard gets
a restart marker at step M+1, so its reader drops the abandoned events itself and shows the same
one curve.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Callable, Iterable, Mapping, Protocol

import jax
import numpy as np
from absl import logging

from distillax import jsonio

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricWriter(Protocol):
  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...
  def flush(self) -> None: ...
  def close(self) -> None: ...


def _as_float(value) -> float:
  return float(np.asarray(value))


# A row of a trajectory a rollback abandoned carries ROLLED_BACK: true; the rollback's own row
# carries ROLLED_BACK_TO: the step the run went back to (trainers/base.py).
ROLLED_BACK, ROLLED_BACK_TO = "rolled_back", "rolled_back_to"


def _parsed(line: str) -> dict | None:
  try:
    row = json.loads(line)
  except json.JSONDecodeError:
    return None
  return row if isinstance(row, dict) else None


def rolled_back_path(metrics_path: str) -> str:
  """Where a rollback puts the abandoned rows of `metrics_path` (metrics.rolled_back.jsonl)."""
  root, ext = os.path.splitext(metrics_path)
  return f"{root}.rolled_back{ext}"


def _rollback_history(row: dict) -> bool:
  return bool(row.get(ROLLED_BACK)) or ROLLED_BACK_TO in row


class JsonlWriter:
  """One JSON object per line, `{"step": int, name: float, ...}`, flushed line by line.

  Opened in append mode so a resumed run continues the file. A line cut short by a crash is
  removed when the file is reopened. The file is strict JSON: a non-finite value (a diverged
  loss) is written as null, so any JSON reader, not only Python's, can read every line.
  """

  def __init__(self, path: str, *, resume_step: int | None = None):
    self.path = path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.exists(path):
      self._repair(resume_step)
    self._file = open(path, "a", encoding="utf-8")

  def _repair(self, resume_step: int | None):
    """Drop a torn last line, and rows after resume_step (rows a rollback marked, and its own
    rows, are history and stay); rewrite atomically only if needed."""
    with open(self.path, encoding="utf-8") as f:
      lines = f.read().split("\n")
    kept, changed = [], False
    # split() leaves '' after a final newline; anything else last is a torn line.
    if lines and lines[-1] == "":
      lines.pop()
    elif lines:
      lines.pop()
      changed = True
    for line in lines:
      if resume_step is not None:
        row = _parsed(line)
        if (row is None or row.get("step") is None
            or (row["step"] > resume_step and not _rollback_history(row))):
          changed = True
          continue
      kept.append(line)
    if changed:
      self._rewrite(kept)

  def _rewrite(self, lines: list[str]) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.write("".join(line + "\n" for line in lines))
    os.replace(tmp, self.path)

  def mark_rolled_back(self, to_step: int) -> None:
    """After a rollback to `to_step`: every row of a later step (not a rollback's own) moves to
    metrics.rolled_back.jsonl, marked `"rolled_back": true`, so this file keeps one history;
    the abandoned rows are written (and synced) before this file is rewritten atomically."""
    self._file.close()
    with open(self.path, encoding="utf-8") as f:
      lines = [line for line in f.read().split("\n") if line]
    kept, abandoned = [], []
    for line in lines:
      row = _parsed(line)
      if row is not None and (row.get("step") or 0) > to_step and not _rollback_history(row):
        abandoned.append(jsonio.dumps({**row, ROLLED_BACK: True}))
      else:
        kept.append(line)
    with open(rolled_back_path(self.path), "a", encoding="utf-8") as f:
      f.write("".join(line + "\n" for line in abandoned))
      f.flush()
      os.fsync(f.fileno())
    self._rewrite(kept)
    self._file = open(self.path, "a", encoding="utf-8")

  def write_scalars(self, step: int, scalars: Mapping[str, float]):
    row = {"step": int(step)}
    row.update((name, _as_float(value)) for name, value in scalars.items() if name != "step")
    self._file.write(jsonio.dumps(row) + "\n")
    self._file.flush()

  def flush(self):
    self._file.flush()

  def close(self):
    if not self._file.closed:
      self._file.close()


def read_jsonl(path: str) -> list[dict]:
  """All rows of a metrics.jsonl file."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _import_tensorboardx():
  """tensorboardX, imported with torch hidden when nothing has imported torch yet.

  Why: tensorboardX's writer imports torch whenever it is installed (the test and Hugging Face
  extras install it), only to accept torch tensors as values, which we never log; that import
  alone costs about 2 s of CPU at the start of every run. Deferred: only process 0 pays for the
  import. Afterwards torch imports as usual.
  """
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError while this entry is None
  try:
    import tensorboardX  # pylint: disable=import-outside-toplevel
  finally:
    if hide and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return tensorboardX


class TensorBoardWriter:
  """Scalars into TensorBoard event files via tensorboardX (no TensorFlow needed).

  Tags are the metric names unchanged, so TensorBoard and metrics.jsonl agree.
  """

  def __init__(self, logdir: str, *, resume_step: int | None = None, flush_secs: int = 10):
    tensorboardX = _import_tensorboardx()
    os.makedirs(logdir, exist_ok=True)
    self.logdir = logdir
    # purge_step hides events at or after it that a crashed earlier run wrote into this logdir.
    purge_step = None if resume_step is None else resume_step + 1
    # Event files are named by the second they were opened; a counter keeps a second writer in
    # the same second (a quick restart) from overwriting the first, and sorts after it.
    earlier_files = len([n for n in os.listdir(logdir) if n.startswith("events.out.tfevents.")])
    self._writer = tensorboardX.SummaryWriter(logdir=logdir, purge_step=purge_step,
                                              flush_secs=flush_secs,
                                              filename_suffix=f".{earlier_files:04d}")

  def mark_rolled_back(self, to_step: int) -> None:
    """After a rollback to `to_step`: a restart marker (SessionLog START) at the next step, by
    which TensorBoard's reader drops the abandoned trajectory's events at or after it, as it
    does for a resumed run's purge_step: the run then shows one history."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    self._writer.flush()
    self._writer._get_file_writer().add_event(  # pylint: disable=protected-access
        Event(step=int(to_step) + 1, session_log=SessionLog(status=SessionLog.START)))
    self._writer.flush()

  def write_scalars(self, step: int, scalars: Mapping[str, float]):
    for name, value in scalars.items():
      self._writer.add_scalar(name, _as_float(value), global_step=int(step))

  def flush(self):
    self._writer.flush()

  def close(self):
    self._writer.close()


def format_value(value: float) -> str:
  """Short form for the console: 4 significant digits, one decimal from 100, scientific at extremes."""
  if value == 0 or not math.isfinite(value):
    return str(value)
  if abs(value) < 1e-3 or abs(value) >= 1e6:
    return f"{value:.3e}"
  if abs(value) >= 100:
    return f"{value:.1f}"
  return f"{value:.4g}"


class ConsoleWriter:
  """One line per logged step: `step 100 | loss 2.345 | lr 1.000e-04`.

  `printer` defaults to absl logging.info; pass `ProgressBar.log` to keep a bar intact.
  """

  def __init__(self, printer: Callable[[str], None] | None = None, prefix: str = ""):
    self._printer = printer or (lambda line: logging.info("%s", line))
    self._prefix = prefix

  def write_scalars(self, step: int, scalars: Mapping[str, float]):
    fields = [f"step {int(step)}"] + [f"{name} {format_value(_as_float(value))}"
                                      for name, value in scalars.items()]
    self._printer(self._prefix + " | ".join(fields))

  def flush(self):
    pass

  def close(self):
    pass


class MultiWriter:
  """Fans rows out to several writers; empty on non-primary processes."""

  def __init__(self, writers: Iterable[MetricWriter] = ()):
    self.writers = list(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, float]):
    for writer in self.writers:
      writer.write_scalars(step, scalars)

  def mark_rolled_back(self, to_step: int) -> None:
    """Each writer's mark_rolled_back where it has one (metrics.jsonl marks the abandoned rows,
    TensorBoard gets a restart marker that hides them; the console keeps what it printed)."""
    for writer in self.writers:
      if hasattr(writer, "mark_rolled_back"):
        writer.mark_rolled_back(to_step)

  def flush(self):
    for writer in self.writers:
      writer.flush()

  def close(self):
    for writer in self.writers:
      writer.close()


def create_writers(workdir: str, *, is_primary: bool | None = None, resume_step: int | None = None,
                   console: bool = True,
                   printer: Callable[[str], None] | None = None) -> MultiWriter:
  """metrics.jsonl + tensorboard/ (+ console) under workdir on process 0; nothing elsewhere."""
  if is_primary is None:
    is_primary = jax.process_index() == 0
  if not is_primary:
    return MultiWriter()
  writers: list[MetricWriter] = [
      JsonlWriter(os.path.join(workdir, METRICS_FILE), resume_step=resume_step),
      TensorBoardWriter(os.path.join(workdir, TENSORBOARD_DIR), resume_step=resume_step),
  ]
  if console:
    writers.append(ConsoleWriter(printer))
  return MultiWriter(writers)
