"""The loop (trainers/base.py): exact resume and recovery from a diverged step.

Resume: a run killed with SIGKILL (or stopped by SIGTERM or Ctrl-C, or whose newest checkpoint is
corrupt) and restarted ends exactly where an uninterrupted run ends: the same parameters and the
same metrics.jsonl, row for row (timing aside), also when it resumes inside a logging window.
Rollback: a NaN injected into one train batch (its loss mask) makes the loss NaN; the loop must
restore the best checkpoint, scale the learning rate by train.rollback_lr_factor, log the event
and finish with finite losses.
"""

import json
import logging
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from distillax.configs import lm as lm_config
from distillax.configs import on_policy as op_config
from distillax.errors import ConfigError, UserError
from distillax.framework.run.preemption import STOPPED_EXIT_CODE
from distillax.interrupts import INTERRUPTED_EXIT_CODE
from distillax.framework.throughput import Throughput
from distillax.trainers import LMRecipe, Trainer, recipe_for
from tests.framework.event_reader import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 10
LOG_EVERY = 3  # rows at 3, 6, 9 (and 10); checkpoints at 4 and 8 fall inside a window
ARGS = ["--config", os.path.join(ROOT, "distillax/configs/lm.py") + ":tiny",
        f"--config.train.steps={STEPS}", f"--config.train.log_every={LOG_EVERY}",
        "--config.train.eval_every=5", "--config.checkpoint.every_steps=4",
        "--config.checkpoint.keep=3"]
# The keys measured by the clock (Throughput.rates), which no two runs share.
TIMING_KEYS = set(Throughput(1, 1.0, 1, 1.0).rates(1, 1.0))
STOPPED_LINE = re.compile(rf"distillax train: stopped at step (\d+) of {STEPS}; rerun the same "
                          r"command to resume")


def _env():
  """The session's environment (tests/conftest.py): its 8 devices, cheap XLA compiles and
  compile cache, which every run here shares: they all compile the same programs."""
  return dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _train(workdir, extra=(), wait=True, args=ARGS, timeout=600):
  cmd = [sys.executable, "-m", "distillax", "train", "--workdir", str(workdir), *args, *extra]
  proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  if wait:
    proc.output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, proc.output[-3000:]
  return proc


def _rows(workdir):
  """Every complete line (the training process may be writing the last one)."""
  lines = (workdir / "metrics.jsonl").read_text().split("\n")[:-1]
  return [json.loads(line) for line in lines if line]


def _train_rows(workdir):
  return {r["step"]: r["loss"] for r in _rows(workdir) if "loss" in r}


def _checkpoint_steps(workdir):
  folder = workdir / "checkpoints"
  if not folder.exists():
    return []
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def _saved_params(workdir, step):
  tree = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")
  return tree["params"]


def _wait_until(proc, reached, what, timeout=600):
  deadline = time.time() + timeout
  while time.time() < deadline:
    assert proc.poll() is None, "training ended before it could be stopped"
    if reached():
      return
    time.sleep(0.05)
  raise AssertionError(f"{what} not reached in {timeout}s")


def _wait_for_step(workdir, proc, step):
  """Until a train row at `step` or later is in metrics.jsonl."""
  path = workdir / "metrics.jsonl"
  _wait_until(proc, lambda: path.exists() and any(s >= step for s in _train_rows(workdir)),
              f"step {step}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  _train(workdir)
  return workdir


def _untimed(rows):
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def _assert_same_run(workdir, reference):
  """The same metrics.jsonl row for row (every key but the timing ones) and the same final
  parameters as the uninterrupted run."""
  rows = _untimed(_rows(workdir))
  assert [r["step"] for r in rows if "loss" in r] == [3, 6, 9, 10]
  assert rows == _untimed(_rows(reference))
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
  # Past checkpoint 4 and at a random later step (4: that checkpoint, 5: the eval row at 5, 6:
  # the row of step 6, written at step 7), so the resume is at 4 or 8: inside a logging window.
  kill_at = random.Random(os.getpid()).randint(4, 6)
  workdir = tmp_path / "killed"
  proc = _train(workdir, wait=False)
  def passed_kill_step():
    steps = _checkpoint_steps(workdir)
    if (workdir / "metrics.jsonl").exists():
      steps += [r["step"] for r in _rows(workdir)]
    return 4 in _checkpoint_steps(workdir) and max(steps) >= kill_at

  _wait_until(proc, passed_kill_step, f"step {kill_at}")
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert max(_train_rows(workdir)) < STEPS, "the run finished before the kill"
  rerun = _train(workdir)
  resumed = int(re.search(r"resuming from step (\d+)", rerun.output).group(1))
  assert resumed in (4, 8) and resumed % LOG_EVERY != 0
  _assert_same_run(workdir, uninterrupted)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(uninterrupted, tmp_path):
  workdir = tmp_path / "corrupt"
  shutil.copytree(uninterrupted, workdir)  # a finished run of this job, as a rerun would leave
  latest = workdir / "checkpoints" / str(STEPS)
  data_files = sorted((latest / "state" / "d").iterdir())
  data_files[0].write_bytes(data_files[0].read_bytes()[:10])  # truncate the array data
  (workdir / "summary.json").unlink()  # as a run killed after its last save leaves it
  proc = _train(workdir, wait=False)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert f"checkpoint step {STEPS}" in out and "corrupt" in out
  # Resumed from the step before, retrained the last steps; the corrupt copy is kept aside.
  assert "resuming from step 8" in out
  assert any(p.name.startswith(f"{STEPS}.corrupt") for p in latest.parent.iterdir())
  _assert_same_run(workdir, uninterrupted)


def _assert_stopped(proc, out, workdir):
  """Exit STOPPED_EXIT_CODE, the stop line last, no traceback, a checkpoint at the stop step and
  an unfinished summary; returns the stop step."""
  assert proc.returncode == STOPPED_EXIT_CODE, out[-3000:]
  assert "Traceback" not in out, out[-3000:]
  last = STOPPED_LINE.fullmatch(out.strip().splitlines()[-1])
  assert last, out[-1000:]
  stopped = int(last.group(1))
  assert 3 <= stopped < STEPS and max(_checkpoint_steps(workdir)) == stopped
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["finished"] is False and summary["step"] == stopped
  return stopped


def _assert_resumes_and_finishes(workdir, stopped, uninterrupted):
  rerun = _train(workdir)
  assert f"resuming from step {stopped}" in rerun.output
  assert rerun.output.strip().splitlines()[-1].startswith(f"distillax train: done at step {STEPS}")
  _assert_same_run(workdir, uninterrupted)


def test_sigterm_saves_the_current_step_and_the_next_run_resumes(uninterrupted, tmp_path):
  workdir = tmp_path / "preempted"
  proc = _train(workdir, wait=False)
  _wait_for_step(workdir, proc, 3)
  os.killpg(proc.pid, signal.SIGTERM)
  out, _ = proc.communicate(timeout=600)
  stopped = _assert_stopped(proc, out, workdir)
  assert "preemption (SIGTERM)" in out
  _assert_resumes_and_finishes(workdir, stopped, uninterrupted)


def test_ctrl_c_saves_the_current_step_and_the_next_run_resumes(uninterrupted, tmp_path):
  workdir = tmp_path / "interrupted"
  proc = _train(workdir, wait=False)
  _wait_for_step(workdir, proc, 3)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=600)
  stopped = _assert_stopped(proc, out, workdir)
  assert "preemption (SIGINT)" in out and "Ctrl-C again aborts" in out
  _assert_resumes_and_finishes(workdir, stopped, uninterrupted)


SECOND_CTRL_C = """
import os, signal
from distillax.framework.run.preemption import PreemptionGuard
guard = PreemptionGuard()
os.kill(os.getpid(), signal.SIGINT)
print("after the first:", guard.received, guard.should_stop(7), flush=True)
os.kill(os.getpid(), signal.SIGINT)
print("still running after the second", flush=True)
"""


def test_a_second_ctrl_c_ends_the_process_at_once():
  proc = subprocess.run([sys.executable, "-c", SECOND_CTRL_C], env=_env(), capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == -signal.SIGINT, (proc.stdout, proc.stderr)
  assert proc.stdout.splitlines() == ["after the first: True True"]
  assert "Ctrl-C again aborts at once" in proc.stderr


# `python -m distillax train` with one point of its start held until the test says go (a file):
# the line says the process is there, the test sends SIGINT, then lets it go on. "checks": the
# wait runs inside a __del__, where Python loses a KeyboardInterrupt (prints "Exception ignored"
# and carries on), as it did inside JAX's gc callback when a user pressed Ctrl-C at 3 s and the
# run trained to its end. "compile": the wait holds the step's XLA compile (its worker thread),
# where Ctrl-C once ended in a segfault.
HELD_START = """
import os, runpy, sys
point, go = sys.argv[1], sys.argv[2]
sys.argv = ["distillax"] + sys.argv[3:]

def hold():
  print("HELD AT", point, flush=True)
  while not os.path.exists(go):
    os.stat(os.path.dirname(go))  # a bytecode loop: Python runs signal handlers between them

if point == "checks":
  from distillax.trainers import base
  class Held:
    def __del__(self):
      hold()
  check = base.check_recipe_data
  base.check_recipe_data = lambda recipe: (check(recipe), Held())[0]
else:
  from distillax.framework import step_program
  compile_step = step_program.AotStep._compile
  step_program.AotStep._compile = staticmethod(lambda lowered: (hold(), compile_step(lowered))[1])
runpy.run_module("distillax", run_name="__main__")
"""


@pytest.mark.parametrize("point", ["checks", "compile"])
def test_ctrl_c_during_the_start_exits_130_with_one_line_and_leaves_nothing(tmp_path, point):
  """Nothing was saved: no advice to resume, not the exit status of a stopped run (3, also
  plan's DOES NOT FIT), and the new workdir is gone again (issue 55 item 13)."""
  workdir, go = tmp_path / "runs" / "run", tmp_path / "go"
  cmd = [sys.executable, "-c", HELD_START, point, str(go), "train", "--workdir", str(workdir),
         *ARGS]
  proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if line.startswith("HELD AT"):
      break
  assert seen and seen[-1].strip() == f"HELD AT {point}", "".join(seen)[-3000:]
  proc.send_signal(signal.SIGINT)
  go.write_text("")
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == INTERRUPTED_EXIT_CODE == 130, out[-3000:]
  assert out.strip().splitlines() == [
      "distillax train: interrupted before its first step; nothing was saved"], out[-3000:]
  # Nothing trained: not even the folders it made (runs/run, its compile cache) are left.
  assert sorted(os.listdir(tmp_path)) == ["go"]


def test_a_step_too_big_for_the_memory_left_is_one_line_and_the_workdir_stays_free(
    tmp_path, capsys, monkeypatch):
  """Issue 48: a teacher too big for the host ran out of memory inside the first step (a
  44-line JaxRuntimeError) and left the workdir locked to the failed job. The compiled step's
  figures are checked against the free memory (1 MiB here, for every device of the host) before
  it runs: one line with them and a fix, exit 2, and no job.json, so another job may take it."""
  from distillax import main as cli
  from distillax.framework.run import memory
  from distillax.trainers.workdir import check_workdir
  monkeypatch.setattr(memory, "free_bytes", lambda device: (2.0 ** 20, 8))
  workdir = tmp_path / "run"
  code = cli.main(["distillax", "train", "--workdir", str(workdir), *ARGS])
  captured = capsys.readouterr().err
  err = [line for line in captured.strip().splitlines() if not re.match(r"I\d{4} ", line)]
  assert code == 2 and len(err) == 1 and "Traceback" not in captured, err  # INFO lines aside
  assert re.fullmatch(r"distillax train: error: the compiled step needs [\d.]+ [KM]iB of "
                      r"temporaries (and [\d.]+ [KM]?i?B of new outputs )?per device beside its [\d.]+ [KM]iB of arguments; 8 devices share this "
                      r"host's memory: [\d.]+ [KM]iB more than the models already take, but "
                      r"1.00 MiB is free; lower train.batch_size .*", err[0]), err[0]
  assert not (workdir / "job.json").exists() and not (workdir / "config.json").exists()
  other = lm_config.get_config("tiny")
  other.seed = 7  # another job
  assert check_workdir(str(workdir), other).summary is None


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


class PoisonedRecipe(LMRecipe):
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
  aside = [json.loads(l) for l in open(tmp_path / "metrics.rolled_back.jsonl") if l.strip()]
  finite = lambda value: value is not None and math.isfinite(value)  # null: not finite (strict)
  poisoned = [r for r in aside if "loss" in r and not finite(r["loss"])]
  assert poisoned and poisoned[0]["step"] == 5
  # Back to the step-4 checkpoint, then steps 5..8 again with half the learning rate.
  messages = [r.getMessage() for r in caplog.records if "rollback" in r.getMessage()]
  assert len(messages) == 1 and "back to step 4" in messages[0], messages
  step5 = [r for r in aside + train if r["step"] == 5 and "loss" in r]
  assert len(step5) == 2 and math.isfinite(step5[1]["loss"])
  assert step5[1]["learning_rate"] == pytest.approx(0.5 * step5[0]["learning_rate"], rel=1e-6)
  assert summary["rollbacks"] == 1 and summary["finished"] and summary["step"] == 8
  assert math.isfinite(summary["loss"]) and math.isfinite(summary["eval_loss"])
  # Rows of the diverged trajectory (steps 5 and 6, one step late) are kept aside; every row
  # after the rollback is finite and the steps run 5..8 again.
  after = train[train.index(step5[1]):]
  assert [r["step"] for r in after] == [5, 6, 7, 8]
  assert all(finite(r["loss"]) for r in after)
  # The diverged trajectory's checkpoints are set aside, the new ones are there.
  kept = {int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()}
  assert 8 in kept
  # metrics.jsonl is one history (issue 48): steps 1-4, the rollback's own row (at step 6,
  # whose row showed the NaN of step 5), then 5-8 again; the abandoned rows of steps 5 and 6
  # are in metrics.rolled_back.jsonl, marked.
  marker = next(i for i, r in enumerate(rows) if "rolled_back_to" in r)
  assert {k: rows[marker][k] for k in ("step", "rolled_back_to", "rollbacks",
                                        "learning_rate_scale")} == {
      "step": 6, "rolled_back_to": 4, "rollbacks": 1, "learning_rate_scale": 0.5}
  assert not any(r.get("rolled_back") for r in rows)
  assert [r["step"] for r in rows[:marker] if "loss" in r] == [1, 2, 3, 4]
  assert [r["step"] for r in aside if "loss" in r] == [5, 6]
  assert all(r["rolled_back"] for r in aside)
  # TensorBoard shows the one history too (issue 48): each step's loss once, the values of the
  # rows of metrics.jsonl, read back as TensorBoard reads (its purge rule).
  board = read_scalars(str(tmp_path / "tensorboard"))
  kept = [(r["step"], r["loss"]) for r in train if not r.get("rolled_back")]
  assert [step for step, _ in board["loss"]] == [step for step, _ in kept] == list(range(1, 9))
  np.testing.assert_allclose([v for _, v in board["loss"]], [v for _, v in kept], rtol=1e-6)


class ScriptedEvals(Trainer):
  """The loop with eval figures given by step instead of measured."""

  def __init__(self, recipe, workdir, script):
    super().__init__(recipe, workdir)
    self.script = script

  def _evaluate(self, state, step):
    ppl, kl = self.script[step]
    return {"eval_objective": 1.5, "eval_loss": math.log(ppl), "eval_perplexity": ppl,
            "eval_tokens": 64.0, "eval_on_policy_reverse_kl": kl}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_on_policy_guard_watches_the_reverse_kl_not_the_next_token_perplexity(tmp_path):
  """On-policy distillation lowers the reverse KL on the student's own samples; its next-token
  perplexity on the data may rise meanwhile. A rise of the perplexity alone (step 4) is no
  rollback; a rise of the reverse KL (step 6) is, and with no rollback left the error's advice
  names that figure and its threshold."""
  config = op_config.get_config("tiny")
  config.on_policy.prompt_len, config.on_policy.max_new_tokens = 6, 6
  config.on_policy.num_samples, config.on_policy.time_sampling = 1, False
  config.train.steps, config.train.eval_every, config.train.max_rollbacks = 6, 2, 0
  config.checkpoint.every_steps, config.checkpoint.async_save = 2, False
  recipe = recipe_for(config)
  assert recipe.rollback_metric == "eval_on_policy_reverse_kl"
  script = {2: (100.0, 0.048), 4: (200.0, 0.030), 6: (150.0, 0.040)}
  with pytest.raises(UserError) as failure:
    ScriptedEvals(recipe, str(tmp_path), script).run()
  message = str(failure.value)
  assert message.startswith("training diverged at step 6 (eval_on_policy_reverse_kl 0.04 vs "
                            "best 0.03)"), message
  assert "train.rollback_threshold=0.05" in message and "train.max_rollbacks" in message
  evals = [r for r in _rows(tmp_path) if "eval_perplexity" in r]
  assert [r["step"] for r in evals] == [2, 4, 6]
  # The run's end is on record (issue 48: a run out of rollbacks wrote no summary.json).
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert {k: summary[k] for k in ("step", "finished", "ended", "reason", "rollbacks")} == {
      "step": 6, "finished": False, "ended": "diverged", "reason": message, "rollbacks": 0}


class FailingEval(LMRecipe):
  """The lm recipe whose held-out data cannot be read when the first eval comes."""

  def eval_iterator(self):
    raise UserError("data.eval_source: the held-out file went away; restore it")


def test_a_failing_eval_saves_its_step_first_and_the_summary_says_why(tmp_path):
  """Issue 48: an eval that failed lost every step since the last checkpoint. The step is saved
  before the error goes up, the error says so, and summary.json records the failure."""
  config = lm_config.get_config("tiny")
  # 8 steps, as the rollback test's: the same train step program (its learning-rate schedule
  # spans train.steps), which the session's compile cache then holds; the eval at 2 ends it.
  config.train.steps, config.train.eval_every, config.train.log_every = 8, 2, 1
  config.checkpoint.every_steps, config.checkpoint.async_save = 4, False  # no save due at 2
  with pytest.raises(UserError) as failure:
    Trainer(FailingEval(config), str(tmp_path)).run()
  assert str(failure.value) == ("data.eval_source: the held-out file went away; restore it "
                                "(step 2 was saved before this eval: the same command resumes "
                                "from it)")
  assert _checkpoint_steps(tmp_path) == [2]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert {k: summary[k] for k in ("step", "finished", "ended", "reason")} == {
      "step": 2, "finished": False, "ended": "failed", "reason": str(failure.value)}
  assert [r["step"] for r in _rows(tmp_path) if "loss" in r] == [1, 2]


class ScriptedAccuracy(Trainer):
  """The loop with eval accuracies given in the order evals happen."""

  def __init__(self, recipe, workdir, accuracies):
    super().__init__(recipe, workdir)
    self.accuracies = list(accuracies)

  def _evaluate(self, state, step):
    return {"eval_objective": 1.5, "eval_loss": 1.5, "eval_perplexity": math.exp(1.5),
            "eval_tokens": 64.0, "eval_accuracy": self.accuracies.pop(0)}


def test_a_higher_is_better_figure_keeps_its_highest_step_and_stops_early(tmp_path):
  """train.rollback_metric=eval_accuracy (higher is better): the best checkpoint kept is the
  step of the highest accuracy (4; a loss-like ranking would keep 2), and two evals without a
  new best (steps 6 and 8) stop the run early, as finished. (The rollback rule in either
  direction: tests/framework/test_eval_rules.py; the loop's rollback: the tests above.)"""
  config = lm_config.get_config("tiny")
  config.train.steps, config.train.eval_every, config.train.log_every = 10, 2, 2
  config.train.rollback_metric, config.train.early_stop_evals = "eval_accuracy", 2
  config.checkpoint.every_steps, config.checkpoint.async_save = 2, False
  config.checkpoint.keep, config.checkpoint.keep_best = 1, 1
  summary = ScriptedAccuracy(LMRecipe(config), str(tmp_path), [0.30, 0.40, 0.39, 0.395]).run()
  assert {k: summary[k] for k in ("step", "finished", "early_stopped", "eval_accuracy")} == {
      "step": 8, "finished": True, "early_stopped": True, "eval_accuracy": 0.395}
  assert [r["step"] for r in _rows(tmp_path) if "eval_accuracy" in r] == [2, 4, 6, 8]
  assert _checkpoint_steps(tmp_path) == [4, 8]
  # The same job again is finished: nothing trains.
  again = ScriptedAccuracy(LMRecipe(config), str(tmp_path), []).run()
  assert again["already_finished"] and again["step"] == 8
  config.train.rollback_metric = "eval_bleu"  # needs eval.generate
  with pytest.raises(ConfigError) as e:
    LMRecipe(config)
  assert str(e.value).startswith("train.rollback_metric='eval_bleu' is not an eval figure the "
                                 "lm job reports; use one of eval_perplexity, eval_loss, "
                                 "eval_objective, eval_accuracy"), str(e.value)
  assert "set eval.generate to a held-out prompt/completion JSONL" in str(e.value)
