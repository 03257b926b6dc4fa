"""The loop (trainers/base.py): exact resume and recovery from a diverged step.

Resume: a run killed with SIGKILL (or stopped by SIGTERM, or whose newest checkpoint is corrupt)
and restarted ends exactly where an uninterrupted run ends.
Rollback: a NaN injected into one train batch (its loss mask) makes the loss NaN; the loop must
restore the best checkpoint, scale the learning rate by train.rollback_lr_factor, log the event
and finish with finite losses.
"""

import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from distillax.configs import lm as lm_config
from distillax.trainers import Recipe, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 10
ARGS = ["--config", os.path.join(ROOT, "distillax/configs/lm.py") + ":tiny",
        f"--config.train.steps={STEPS}", "--config.train.log_every=1",
        "--config.train.eval_every=5", "--config.checkpoint.every_steps=2",
        "--config.checkpoint.keep=3"]


def _env():
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  return env


def _train(workdir, extra=(), wait=True):
  cmd = [sys.executable, "-m", "distillax", "train", "--workdir", str(workdir), *ARGS, *extra]
  proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  if wait:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
  return proc


def _train_rows(workdir):
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines() if l]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _saved_params(workdir, step):
  tree = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")
  return tree["params"]


def _wait_for_step(workdir, proc, step, timeout=240):
  deadline = time.time() + timeout
  path = workdir / "metrics.jsonl"
  while time.time() < deadline:
    assert proc.poll() is None, "training ended before it could be killed"
    if path.exists() and any(s >= step for s in _train_rows(workdir)):
      return
    time.sleep(0.05)
  raise AssertionError(f"step {step} not reached in {timeout}s")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  _train(workdir)
  return workdir


def _assert_same_run(workdir, reference):
  ref_rows, rows = _train_rows(reference), _train_rows(workdir)
  assert sorted(rows) == list(range(1, STEPS + 1))
  np.testing.assert_array_equal([rows[s] for s in sorted(rows)],
                                [ref_rows[s] for s in sorted(ref_rows)])
  got, want = _saved_params(workdir, STEPS), _saved_params(reference, STEPS)
  flat_got = {k: np.asarray(v) for k, v in _flatten(got).items()}
  for k, v in _flatten(want).items():
    np.testing.assert_array_equal(flat_got[k], np.asarray(v), err_msg=k)


def _flatten(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}/"))
    else:
      out[prefix + k] = v
  return out


def test_sigkill_at_a_random_step_then_resume_matches(uninterrupted, tmp_path):
  kill_at = random.Random(os.getpid()).randint(3, 7)
  workdir = tmp_path / "killed"
  proc = _train(workdir, wait=False)
  _wait_for_step(workdir, proc, kill_at)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert max(_train_rows(workdir)) < STEPS, "the run finished before the kill"
  _train(workdir)
  _assert_same_run(workdir, uninterrupted)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(uninterrupted, tmp_path):
  workdir = tmp_path / "corrupt"
  _train(workdir)
  latest = workdir / "checkpoints" / str(STEPS)
  data_files = sorted((latest / "state" / "d").iterdir())
  data_files[0].write_bytes(data_files[0].read_bytes()[:10])  # truncate the array data
  proc = _train(workdir, wait=False)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  assert f"checkpoint step {STEPS}" in out and "corrupt" in out
  # Resumed from the step before, retrained the last steps; the corrupt copy is kept aside.
  assert "resuming from step 8" in out
  assert any(p.name.startswith(f"{STEPS}.corrupt") for p in latest.parent.iterdir())
  _assert_same_run(workdir, uninterrupted)


def test_sigterm_saves_the_current_step_and_the_next_run_resumes(uninterrupted, tmp_path):
  workdir = tmp_path / "preempted"
  proc = _train(workdir, wait=False)
  _wait_for_step(workdir, proc, 3)
  os.killpg(proc.pid, signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out[-3000:]
  stopped = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert 3 <= stopped < STEPS and "preemption" in out
  _train(workdir)
  _assert_same_run(workdir, uninterrupted)


# ---- rollback -------------------------------------------------------------------------------

class PoisonOnce:
  """Wraps a train iterator; the `at`-th batch handed out in the process gets a NaN loss mask."""

  def __init__(self, inner, counter):
    self.inner, self.counter = inner, counter

  def __next__(self):
    batch = next(self.inner)
    self.counter["served"] += 1
    if self.counter["served"] == self.counter["at"]:
      batch = dict(batch, loss_mask_BxL=np.full_like(batch["loss_mask_BxL"], np.nan))
    return batch

  def get_state(self):
    return self.inner.get_state()

  def set_state(self, state):
    self.inner.set_state(state)


class PoisonedRecipe(Recipe):
  """The lm recipe whose train batches pass through PoisonOnce."""
  counter = {"served": 0, "at": 5}

  def train_iterator(self):
    return PoisonOnce(super().train_iterator(), self.counter)


def test_nan_loss_rolls_back_to_the_best_checkpoint(tmp_path, caplog):
  config = lm_config.get_config("tiny")
  config.train.steps, config.train.log_every, config.train.eval_every = 8, 1, 2
  config.checkpoint.every_steps, config.checkpoint.async_save = 2, False
  config.train.rollback_lr_factor = 0.5
  trainer = Trainer(PoisonedRecipe(config), str(tmp_path))
  with caplog.at_level(logging.WARNING):
    summary = trainer.run()

  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl") if l.strip()]
  train = [r for r in rows if "loss" in r]
  poisoned = [r for r in train if not math.isfinite(r["loss"])]
  assert poisoned and poisoned[0]["step"] == 5
  # Back to the step-4 checkpoint, then steps 5..8 again with half the learning rate.
  messages = [r.getMessage() for r in caplog.records if "rollback" in r.getMessage()]
  assert len(messages) == 1 and "back to step 4" in messages[0], messages
  step5 = [r for r in train if r["step"] == 5]
  assert len(step5) == 2 and math.isfinite(step5[1]["loss"])
  assert step5[1]["learning_rate"] == pytest.approx(0.5 * step5[0]["learning_rate"], rel=1e-6)
  assert summary["rollbacks"] == 1 and summary["finished"] and summary["step"] == 8
  assert math.isfinite(summary["loss"]) and math.isfinite(summary["eval_loss"])
  # Rows of the diverged trajectory (steps 5 and 6, one step late) stay in the log; every row
  # after the rollback is finite and the steps run 5..8 again.
  after = train[train.index(step5[1]):]
  assert [r["step"] for r in after] == [5, 6, 7, 8]
  assert all(math.isfinite(r["loss"]) for r in after)
  # The diverged trajectory's checkpoints are set aside, the new ones are there.
  kept = {int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()}
  assert 8 in kept
