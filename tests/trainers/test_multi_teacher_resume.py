"""Distillation from several routed teachers resumes exactly after SIGKILL: no teacher is in the
checkpoints (each is reloaded from its source and checked by fingerprint), and the routed data
position is every route's own iterator state, so the rerun ends with the metrics rows and the
parameters of an uninterrupted run."""

import os

import pytest

from tests.trainers.kill_and_resume import assert_same_run, killed_run, resume_step
from tests.trainers.test_base import ROOT, _checkpoint_steps, _train_rows

STEPS = 18  # steps of milliseconds after the first checkpoint: the kill lands mid-run
ARGS = ["--config", os.path.join(ROOT, "distillax/configs/distill_multi_teacher.py") + ":tiny",
        f"--config.train.steps={STEPS}", "--config.train.log_every=2",
        "--config.train.eval_every=0", "--config.checkpoint.every_steps=3",
        "--config.checkpoint.keep=2", "--config.distill.teachers_mode=routing",
        "--config.distill.routes=(('stdlib', 'b'), ('stdlib', 'a'))"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_sigkill_then_resume_with_routed_teachers_equals_an_uninterrupted_run(tmp_path):
  reference, workdir = killed_run(
      tmp_path, ARGS, lambda w: 3 in _checkpoint_steps(w) and (w / "metrics.jsonl").exists()
      and max(_train_rows(w), default=0) >= 4, "step 4")
  assert max(_train_rows(workdir)) < STEPS, "the run finished before the kill"
  assert resume_step(workdir, ARGS) >= 3
  assert_same_run(workdir, reference, STEPS)
  # The checkpoints hold the student alone; teachers.json names both teachers.
  assert (workdir / "teachers.json").read_text() == (reference / "teachers.json").read_text()
