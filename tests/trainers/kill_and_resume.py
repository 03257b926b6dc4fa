"""One SIGKILL-resume experiment, shared by the jobs that must resume exactly: an uninterrupted
run, the same job killed once its workdir shows a chosen state, and the rerun of the killed
workdir; then the rows (timing keys aside) and final parameters of both compared."""

import os
import re
import signal

import jax
import numpy as np

from distillax.framework.throughput import Throughput
from tests.trainers.test_base import _rows, _saved_params, _train, _wait_until

# Measured by the clock, never equal between two runs.
TIMING_KEYS = frozenset(Throughput(1, 1.0, 1, 1.0).rates(1, 1.0))


def killed_run(tmp_path, args, ready, what: str):
  """(the uninterrupted workdir, the workdir of the run SIGKILLed once `ready(workdir)`)."""
  reference = tmp_path / "uninterrupted"
  _train(reference, args=args, timeout=900)
  workdir = tmp_path / "killed"
  proc = _train(workdir, wait=False, args=args)
  _wait_until(proc, lambda: ready(workdir), what, 900)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  return reference, workdir


def resume_step(workdir, args) -> int:
  """Reruns the killed workdir to the end; the step it said it resumed from."""
  rerun = _train(workdir, args=args, timeout=900)
  return int(re.search(r"resuming from step (\d+)", rerun.output).group(1))


def untimed_rows(workdir, timing_keys=TIMING_KEYS):
  return [{k: v for k, v in r.items() if k not in timing_keys} for r in _rows(workdir)]


def assert_same_run(workdir, reference, steps: int, timing_keys=TIMING_KEYS):
  """Equal metrics rows (timing aside) and bit-equal parameters saved at `steps`; the rows."""
  got, want = untimed_rows(workdir, timing_keys), untimed_rows(reference, timing_keys)
  assert [r["step"] for r in got] == [r["step"] for r in want]
  assert got == want
  got_params, want_params = _saved_params(workdir, steps), _saved_params(reference, steps)
  assert jax.tree.structure(got_params) == jax.tree.structure(want_params)
  for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  return want
