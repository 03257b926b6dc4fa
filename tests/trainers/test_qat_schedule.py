"""Progressive QAT (`qat.schedule`): a run steps int8 -> q4_0 at the stages' first steps
over one state (optimizer state and data position kept), and a run stopped inside a stage
resumes across the next switch exactly.

The reference is the same training stepped by hand with engines of two plain recipes
(qat.rules=int8, qat.rules=q4_0): a scheduled run's losses, step by step, and its final
parameters must be that reference's.
"""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from distillax.configs import lm as lm_config
from distillax.errors import ConfigError
from distillax.framework.run.preemption import PreemptionGuard
from distillax.quant import QuantConfig
from distillax.trainers import Trainer, recipe_for
from distillax.trainers import loop_tools

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

INT8 = (("", None, None, None), (".*", "int8", None, None))
Q4_0 = (("", None, None, None), (".*", "q4_0", None, None))
# Steps 0-1 int8, 2-3 q4_0 (counted from 0). A full-precision start is the delayed start's
# engine, tested with it (tests/quant/test_qat.py); leaving it out saves a compile.
SCHEDULE = ((0, INT8), (2, Q4_0))
STEPS = 4


def _config(rules=(), schedule=()):
  c = lm_config.get_config("tiny")
  c.train.steps, c.train.log_every, c.train.eval_every = STEPS, 1, 0
  c.checkpoint.every_steps, c.checkpoint.async_save = 0, False
  c.qat.rules, c.qat.schedule = rules, schedule
  return c


class _StopAt(PreemptionGuard):
  """A preemption that arrives once step `STOP` is done (as SIGTERM would, in-process)."""

  STOP = 1

  def should_stop(self, step):
    if int(step) >= self.STOP:
      self.request_stop()
    return super().should_stop(step)


def _by_hand():
  """(losses of steps 1..STEPS, final params): each stage's steps run by its own recipe's
  engine, one state and one data iterator throughout."""
  recipes = [recipe_for(_config(rules)) for rules in (INT8, Q4_0)]
  engines = [r.build_engines().main for r in recipes]
  student, extras = recipes[0].build(abstract=False)
  state = engines[0].init_state(student, extras, 0)
  batches, losses = recipes[0].train_iterator(), []
  for step in range(STEPS):
    runner = engines[sum(step >= first for first, _ in SCHEDULE) - 1].runner
    state, metrics = runner(state, runner.place_batch(next(batches)))
    losses.append(float(jax.device_get(metrics["loss"])))
  return losses, jax.device_get(engines[0].global_state(state).params)


def _saved_params(workdir, step):
  return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")["params"]


def test_schedule_switches_at_its_steps_and_resumes_across_a_switch(tmp_path, monkeypatch):
  with monkeypatch.context() as patch:
    patch.setattr(loop_tools, "PreemptionGuard", _StopAt)
    stopped = Trainer(recipe_for(_config(schedule=SCHEDULE)), str(tmp_path)).run()
  assert not stopped["finished"] and stopped["step"] == _StopAt.STOP  # inside the int8 stage
  resumed = Trainer(recipe_for(_config(schedule=SCHEDULE)), str(tmp_path))
  assert resumed.run()["finished"]
  saved = _saved_params(tmp_path, STEPS)
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl") if l.strip()]
  ours = {r["step"]: r["loss"] for r in rows if "loss" in r}
  want, want_params = _by_hand()
  np.testing.assert_allclose([ours[s] for s in range(1, STEPS + 1)], want, rtol=1e-6)
  ours_leaves, want_leaves = jax.tree.leaves(saved), jax.tree.leaves(want_params)
  assert len(ours_leaves) == len(want_leaves)
  for a, b in zip(ours_leaves, want_leaves):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qat, message", [
    ({"schedule": ((4, INT8), (4, Q4_0))}, "qat.schedule[1] step=4 is not after"),
    ({"schedule": ((4, ()),)}, "qat.schedule[0] rules=(); give at least one"),
    ({"schedule": ((2, INT8),), "start_step": 2}, "qat.start_step=2 and qat.schedule are both"),
    ({"schedule": ((2, INT8),), "rules": Q4_0}, "qat.rules and qat.schedule are both set"),
    ({"schedule": ((-1, INT8),)}, "qat.schedule[0] step=-1 must be a non-negative integer"),
    ({"schedule": ((2, ((".*", "int3", None, None),)),)}, "weight_qtype='int3'"),
])
def test_bad_schedules_are_one_line_config_errors(qat, message):
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")
                     .replace(")", r"\)")) as error:
    QuantConfig.from_config(qat)
  assert "\n" not in str(error.value)


def test_the_loaded_form_names_no_none_quantization_type():
  """Issue 55: `generate` on the README's QAT run said "fake-quant None/q4_0 weights": its first
  rule keeps the embedding in full precision (weight type None), which is said as that."""
  from distillax.trainers.transforms import StudentTransforms
  config = lm_config.get_config("tiny")
  with config.unlocked():
    config.qat = {"rules": (("", None, None, None), (".*", "q4_0", "q8_0", None)),
                  "start_step": 0, "schedule": ()}
  form = StudentTransforms.from_config(config).describe(fake_quant=True, lora_merged=True)
  assert form == ("fake-quant q4_0 weights, q8_0 activations, the rest full precision "
                  "(qat.rules: the forward QAT trains)")
