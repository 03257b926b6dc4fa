"""Cross-tokenizer on-policy runs resume exactly after SIGKILL: the sampling program's key is a
function of the checkpointed RNG and step, the prompt position is part of the data state, and
the host's alignment is a function of the samples, so the resumed run's metrics rows and final
parameters equal an uninterrupted run's (the tiniest job: one device, four steps)."""

import os

import pytest

from tests.trainers.kill_and_resume import TIMING_KEYS, assert_same_run, killed_run, resume_step
from tests.trainers.test_base import ROOT, _checkpoint_steps

STEPS = 4
ARGS = ["--config", os.path.join(ROOT, "distillax/configs/distill_cross_tokenizer.py")
        + ":tiny,on_policy", "--devices", "1", f"--config.train.steps={STEPS}",
        "--config.train.log_every=1", f"--config.train.eval_every={STEPS}",
        "--config.checkpoint.every_steps=2", "--config.train.batch_size=2",
        "--config.on_policy.max_new_tokens=8", "--config.train.eval_batches=1"]
TIMING = TIMING_KEYS | {"sampling_s", "host_alignment_s"}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
  reference, workdir = killed_run(tmp_path, ARGS, lambda w: 2 in _checkpoint_steps(w),
                                  "the step-2 checkpoint")
  assert STEPS not in _checkpoint_steps(workdir), "the run finished before the kill"
  assert resume_step(workdir, ARGS) == 2
  want = assert_same_run(workdir, reference, STEPS, TIMING)
  assert all(r["exact_kl"] > 0 for r in want if "loss" in r)  # the teacher graded every step
