"""The teacher's attention follows the student's choice (issue 48, item 5): `plan --target
gpu:...` of a distillation with model.attention_impl=blockwise compiled the teacher with cuDNN
(its preset's 'auto'). teacher.attention_impl sets the teacher's own; '' follows the model
section; several teachers follow it too. The GPU compile itself: tests/plan/test_target.py."""

import pytest

from distillax.configs import distill, distill_multi_teacher
from distillax.errors import ConfigError
from distillax.trainers import recipe_for


def _recipe(module, student: str, teacher: str | None = None):
  c = module.get_config("tiny")
  c.model.attention_impl = student
  if teacher is not None:
    c.teacher.attention_impl = teacher
  return recipe_for(c)


@pytest.mark.parametrize("student, teacher, runs", [
    ("blockwise", "", "blockwise"),  # follows the student
    ("reference", "", "reference"),
    ("reference", "blockwise", "blockwise"),  # its own
])
def test_the_teacher_runs_the_students_attention_unless_it_has_its_own(student, teacher, runs):
  recipe = _recipe(distill, student, teacher)
  assert recipe.model_config.attention_impl == student
  assert recipe.teacher_model_config.attention_impl == runs
  # The stored preset says 'auto': the choice is not the source's.
  assert recipe.teacher_source.model_config().attention_impl == "auto"


def test_several_teachers_follow_the_student():
  recipe = _recipe(distill_multi_teacher, "reference")
  impls = {t.name: t.model_config.attention_impl for t in recipe.teachers}
  assert impls and set(impls.values()) == {"reference"}, impls


def test_an_unknown_teacher_attention_is_one_line():
  with pytest.raises(ConfigError, match=r"teacher.attention_impl='flash'; choose one of auto, "
                                        r"reference, blockwise"):
    _recipe(distill, "auto", "flash")
