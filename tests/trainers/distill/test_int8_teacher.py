"""`teacher.int8`: a distill job whose frozen teacher runs int8 matmuls (the numerics are
tests/quant/test_int8.py): it trains, its teacher's state holds int8 codes, and the jobs it
cannot serve are refused in one line."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.configs import distill, distill_multi_teacher
from distillax.errors import UserError
from distillax.quant.int8_model import Int8Weight
from distillax.trainers import Trainer, recipe_for
from distillax.trainers.sources import BlocksSource

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _tiny(steps: int = 6):
  c = distill.get_config("tiny")
  c.teacher.int8 = True
  c.train.steps, c.train.log_every, c.train.eval_every = steps, 1, 0
  c.checkpoint.every_steps, c.checkpoint.async_save = 0, False
  return c


def test_a_distill_job_with_an_int8_teacher_trains(tmp_path):
  recipe = recipe_for(_tiny())
  _, extras = recipe.build(abstract=True)  # what the step is compiled for
  weights = [n for _, n in nnx.iter_graph(extras["teacher"]) if isinstance(n, Int8Weight)]
  assert len(weights) == 7 * recipe.teacher_model_config.num_layers + 1  # blocks + the head
  assert all(w.codes.dtype == jnp.int8 for w in weights)
  assert recipe.teacher_source.fingerprint()["int8"] is True  # a resume reloads it as int8
  assert Trainer(recipe, str(tmp_path)).run()["finished"]
  losses = [json.loads(line)["loss"] for line in open(tmp_path / "metrics.jsonl")
            if '"loss"' in line]
  assert len(losses) == 6 and np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.02


def test_a_student_of_teacher_blocks_copies_the_stored_teacher():
  """student.from_teacher copies the teacher's own weights, not its int8 codes."""
  c = _tiny()
  c.student.from_teacher.layers = (1,)
  recipe = recipe_for(c)
  assert isinstance(recipe.sources.student, BlocksSource)
  assert recipe.sources.student.fingerprint().get("int8") is None
  assert recipe.teacher_source.fingerprint()["int8"] is True


def test_teachers_it_cannot_serve_are_refused_in_one_line(tmp_path):
  cached = _tiny()
  cached.teacher.cache_dir = str(tmp_path)
  several = distill_multi_teacher.get_config("tiny")
  several.teachers[1].int8 = True
  for config, words in ((cached, "teacher.cache_dir"), (several, r"teachers\[1\].int8")):
    with pytest.raises(UserError, match=words) as e:
      recipe_for(config)
    assert "\n" not in str(e.value)
