"""Distillation from several routed teachers resumes exactly after SIGKILL: no teacher is in the
checkpoints (each is reloaded from its source and checked by fingerprint), and the routed data
position is every route's own iterator state, so the rerun ends with the metrics rows and the
parameters of an uninterrupted run."""

import os
import re
import signal

import jax
import numpy as np
import pytest

from distillax.framework.throughput import Throughput
from tests.trainers.test_base import (ROOT, _checkpoint_steps, _rows, _saved_params, _train,
                                      _train_rows, _wait_until)

STEPS = 18  # steps of milliseconds after the first checkpoint: the kill lands mid-run
ARGS = ["--config", os.path.join(ROOT, "distillax/configs/distill_multi_teacher.py") + ":tiny",
        f"--config.train.steps={STEPS}", "--config.train.log_every=2",
        "--config.train.eval_every=0", "--config.checkpoint.every_steps=3",
        "--config.checkpoint.keep=2", "--config.distill.teachers_mode=routing",
        "--config.distill.routes=(('stdlib', 'b'), ('stdlib', 'a'))"]
TIMING_KEYS = set(Throughput(1, 1.0, 1, 1.0).rates(1, 1.0))


def _untimed_rows(workdir):
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in _rows(workdir)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_sigkill_then_resume_with_routed_teachers_equals_an_uninterrupted_run(tmp_path):
  reference = tmp_path / "uninterrupted"
  _train(reference, args=ARGS, timeout=900)
  workdir = tmp_path / "killed"
  proc = _train(workdir, wait=False, args=ARGS)
  _wait_until(proc, lambda: 3 in _checkpoint_steps(workdir) and (workdir / "metrics.jsonl")
              .exists() and max(_train_rows(workdir), default=0) >= 4, "step 4", 900)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert max(_train_rows(workdir)) < STEPS, "the run finished before the kill"
  rerun = _train(workdir, args=ARGS, timeout=900)
  assert int(re.search(r"resuming from step (\d+)", rerun.output).group(1)) >= 3
  got, want = _untimed_rows(workdir), _untimed_rows(reference)
  assert [r["step"] for r in got] == [r["step"] for r in want]
  assert got == want
  for a, b in zip(jax.tree.leaves(_saved_params(workdir, STEPS)),
                  jax.tree.leaves(_saved_params(reference, STEPS))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The checkpoints hold the student alone; teachers.json names both teachers.
  assert (workdir / "teachers.json").read_text() == (reference / "teachers.json").read_text()
