"""On-policy runs resume exactly after SIGKILL: the sampling key is a function of the
checkpointed RNG and step, the prompt position is part of the data state, so the resumed run's
metrics rows (sampled completion lengths included) and final parameters equal an uninterrupted
run's."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from distillax.framework.throughput import Throughput

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 8
ARGS = ["--config", os.path.join(ROOT, "distillax/configs/on_policy.py") + ":tiny",
        f"--config.train.steps={STEPS}", "--config.train.log_every=3",
        "--config.train.eval_every=4", "--config.checkpoint.every_steps=3",
        "--config.checkpoint.keep=3", "--config.on_policy.divergence=sampled_kl",
        "--config.on_policy.lmbda=0.75"]
# Measured by the clock, never equal between two runs.
TIMING_KEYS = set(Throughput(1, 1.0, 1, 1.0).rates(1, 1.0)) | {"sampled_tokens_per_s",
                                                                "sampling_share"}


def _train(workdir, wait=True):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  cmd = [sys.executable, "-m", "distillax", "train", "--workdir", str(workdir), *ARGS]
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  if wait:
    proc.output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, proc.output[-3000:]
  return proc


def _rows(workdir):
  lines = (workdir / "metrics.jsonl").read_text().split("\n")[:-1]
  return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
          for line in lines if line]


def _params(workdir):
  tree = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(STEPS) / "state")
  return tree["params"]


def _checkpoints(workdir):
  folder = workdir / "checkpoints"
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() \
      else []


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
  reference = tmp_path / "uninterrupted"
  _train(reference)
  workdir = tmp_path / "killed"
  proc = _train(workdir, wait=False)
  deadline = time.time() + 900
  while 3 not in _checkpoints(workdir):  # killed inside the step-4 eval or just after it
    assert proc.poll() is None and time.time() < deadline, "the run ended before the kill"
    time.sleep(0.05)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert STEPS not in _checkpoints(workdir), "the run finished before the kill"
  rerun = _train(workdir)
  assert int(re.search(r"resuming from step (\d+)", rerun.output).group(1)) in (3, 6)
  got, want = _rows(workdir), _rows(reference)
  assert [r["step"] for r in got] == [r["step"] for r in want]
  assert got == want
  assert any(0 < r.get("on_policy", 0) < 1 for r in want)  # both branches ran in a window
  for a, b in zip(jax.tree.leaves(_params(workdir)), jax.tree.leaves(_params(reference))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  samples = sorted(p.name for p in (workdir / "on_policy_samples").iterdir())
  assert samples == ["step_000004.jsonl", "step_000008.jsonl"]
  for name in samples:
    assert (workdir / "on_policy_samples" / name).read_text() == (
        reference / "on_policy_samples" / name).read_text()

