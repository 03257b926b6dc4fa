"""On-policy distillation from several teachers (distill/on_policy/objective.py with a TeacherMix): identical
teachers give the one-teacher objective (same samples, same loss and reverse KL), and routing
grades each prompt's completions by its own teacher only. (Their gradients agree too: routing
exactly, the mixture within float32 rounding of its log-sum-exp, measured 1.6e-6 against
entries ~1e-2; compiling the backward here cost the module a quarter more CPU time.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.distill.multi_teacher import TeacherMix
from distillax.distill.on_policy.objective import (PROMPT_LENGTHS, PROMPT_TEACHER, PROMPT_TOKENS, ROW_IDS,
                                         OnPolicySettings, make_on_policy_objective)
from distillax.distill.on_policy.losses import GeneralizedJSD
from tests.distill import helpers as h
from tests.support.models import NORMS_NEAR_ONE, random_model

LEAF = GeneralizedJSD(beta=0.3, temperature=1.5)
SETTINGS = OnPolicySettings(max_new_tokens=5, num_samples=2, eos_id=3, pad_id=0)
LENGTHS = np.array([4, 2, 3], np.int32)
ROUTE = np.array([1, 0, 1], np.int32)  # prompt i's teacher: b, a, b
SINGLE = make_on_policy_objective(LEAF, SETTINGS, chunk_size=4)


def several(mode):
  return make_on_policy_objective(LEAF, SETTINGS, chunk_size=4,
                                  teachers=TeacherMix(("a", "b"), mode, (1.0, 3.0)))


@pytest.fixture(scope="module")
def models():
  student, teacher = h.make_models(3)
  return student, teacher, random_model(h.TEACHER_CONFIG, 321, NORMS_NEAR_ONE)


def prompt_batch(lengths=LENGTHS):
  prompts = np.random.default_rng(0).integers(4, h.VOCAB, (3, 4)).astype(np.int32)
  prompts[np.arange(4)[None] >= np.asarray(lengths)[:, None]] = 0
  return {PROMPT_TOKENS: jnp.asarray(prompts), PROMPT_LENGTHS: jnp.asarray(lengths),
          ROW_IDS: jnp.arange(3, dtype=jnp.int32), PROMPT_TEACHER: jnp.asarray(ROUTE)}


_COMPILED = {}


def evaluate(objective, student, extras, batch):
  """(loss, reverse_kl sum, completion tokens); one compile per objective."""
  if objective not in _COMPILED:
    def run(student, extras, batch):
      out = objective(student, extras, batch, jax.random.key(5))
      return out.loss_sum, out.ratios["reverse_kl"][0], out.tokens
    _COMPILED[objective] = jax.jit(run)
  return tuple(float(x) for x in _COMPILED[objective](student, extras, batch))


def test_identical_teachers_equal_one_teacher(models):
  student, teacher, _ = models
  batch = prompt_batch()
  want = evaluate(SINGLE, student, {"teacher": teacher}, batch)
  for mode in ("mixture", "routing"):
    got = evaluate(several(mode), student, {"teacher:a": teacher, "teacher:b": teacher}, batch)
    assert got[2] == want[2] > 0, mode  # the same samples: the same completion tokens
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-6, err_msg=mode)


def test_routing_grades_each_prompt_by_its_own_teacher(models):
  """Routed [b, a, b] = prompts 0 and 2 alone with b + prompt 1 alone with a (a prompt alone:
  the others' lengths 0, so they count nothing; each row's samples are keyed by its row id)."""
  student, teacher_a, teacher_b = models
  routed, _, tokens = evaluate(several("routing"), student,
                               {"teacher:a": teacher_a, "teacher:b": teacher_b}, prompt_batch())

  def alone(rows, teacher):
    lengths = np.where(np.isin(np.arange(3), rows), LENGTHS, 0).astype(np.int32)
    return evaluate(SINGLE, student, {"teacher": teacher}, prompt_batch(lengths))

  b, a = alone([0, 2], teacher_b), alone([1], teacher_a)
  assert b[2] + a[2] == tokens
  np.testing.assert_allclose(routed, b[0] + a[0], rtol=1e-6)
  assert abs(alone([1], teacher_b)[0] - a[0]) > 1e-3  # the teachers do differ on prompt 1
