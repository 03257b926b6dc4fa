"""Cross-tokenizer on-policy runs resume exactly after SIGKILL: the sampling program's key is a
function of the checkpointed RNG and step, the prompt position is part of the data state, and
the host's alignment is a function of the samples, so the resumed run's metrics rows and final
parameters equal an uninterrupted run's (the tiniest job: one device, four steps)."""

import os
import re
import signal

import jax
import numpy as np
import pytest

from distillax.framework.throughput import Throughput
from tests.trainers.test_base import (ROOT, _checkpoint_steps, _rows, _saved_params, _train,
                                      _wait_until)

STEPS = 4
ARGS = ["--config", os.path.join(ROOT, "distillax/configs/distill_cross_tokenizer.py")
        + ":tiny,on_policy", "--devices", "1", f"--config.train.steps={STEPS}",
        "--config.train.log_every=1", f"--config.train.eval_every={STEPS}",
        "--config.checkpoint.every_steps=2", "--config.train.batch_size=2",
        "--config.on_policy.max_new_tokens=8", "--config.train.eval_batches=1"]
# Measured by the clock, never equal between two runs.
TIMING_KEYS = set(Throughput(1, 1.0, 1, 1.0).rates(1, 1.0)) | {"sampling_s", "host_alignment_s"}


def _untimed_rows(workdir):
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in _rows(workdir)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
  reference = tmp_path / "uninterrupted"
  _train(reference, args=ARGS, timeout=900)
  workdir = tmp_path / "killed"
  proc = _train(workdir, wait=False, args=ARGS)
  _wait_until(proc, lambda: 2 in _checkpoint_steps(workdir), "the step-2 checkpoint", 900)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert STEPS not in _checkpoint_steps(workdir), "the run finished before the kill"
  rerun = _train(workdir, args=ARGS, timeout=900)
  assert int(re.search(r"resuming from step (\d+)", rerun.output).group(1)) == 2
  got, want = _untimed_rows(workdir), _untimed_rows(reference)
  assert [r["step"] for r in got] == [r["step"] for r in want]
  assert got == want
  assert all(r["exact_kl"] > 0 for r in want if "loss" in r)  # the teacher graded every step
  for a, b in zip(jax.tree.leaves(_saved_params(workdir, STEPS)),
                  jax.tree.leaves(_saved_params(reference, STEPS))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
