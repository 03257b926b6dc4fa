"""On-policy runs resume exactly after SIGKILL: the sampling key is a function of the
checkpointed RNG and step, the prompt position is part of the data state, so the resumed run's
metrics rows (sampled completion lengths included) and final parameters equal an uninterrupted
run's."""

import os
import re
import signal

import jax
import numpy as np
import pytest

from distillax.framework.throughput import Throughput
from tests.trainers.test_base import (ROOT, _checkpoint_steps, _rows, _saved_params, _train,
                                      _wait_until)

STEPS = 8
ARGS = ["--config", os.path.join(ROOT, "distillax/configs/on_policy.py") + ":tiny",
        f"--config.train.steps={STEPS}", "--config.train.log_every=3",
        "--config.train.eval_every=4", "--config.checkpoint.every_steps=3",
        "--config.checkpoint.keep=3", "--config.on_policy.divergence=sampled_kl",
        "--config.on_policy.lmbda=0.75"]
# Measured by the clock, never equal between two runs.
TIMING_KEYS = set(Throughput(1, 1.0, 1, 1.0).rates(1, 1.0)) | {"sampled_tokens_per_s",
                                                                "sampling_share"}


def _untimed_rows(workdir):
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in _rows(workdir)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
  reference = tmp_path / "uninterrupted"
  _train(reference, args=ARGS, timeout=900)
  workdir = tmp_path / "killed"
  proc = _train(workdir, wait=False, args=ARGS)
  # Killed inside the step-4 eval or just after it.
  _wait_until(proc, lambda: 3 in _checkpoint_steps(workdir), "the step-3 checkpoint", 900)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert STEPS not in _checkpoint_steps(workdir), "the run finished before the kill"
  rerun = _train(workdir, args=ARGS, timeout=900)
  assert int(re.search(r"resuming from step (\d+)", rerun.output).group(1)) in (3, 6)
  got, want = _untimed_rows(workdir), _untimed_rows(reference)
  assert [r["step"] for r in got] == [r["step"] for r in want]
  assert got == want
  assert any(0 < r.get("on_policy", 0) < 1 for r in want)  # both branches ran in a window
  for a, b in zip(jax.tree.leaves(_saved_params(workdir, STEPS)),
                  jax.tree.leaves(_saved_params(reference, STEPS))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  samples = sorted(p.name for p in (workdir / "on_policy_samples").iterdir())
  assert samples == ["step_000004.jsonl", "step_000008.jsonl"]
  for name in samples:
    assert (workdir / "on_policy_samples" / name).read_text() == (
        reference / "on_policy_samples" / name).read_text()

