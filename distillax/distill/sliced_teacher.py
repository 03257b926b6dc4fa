"""The teacher a loss over vocabulary slices reads (framework/vocab_slices.py): one model's output
layer or a hidden-state cache's head (`output_operands`), or several teachers side by side
(multi_teacher.TeacherSet) folded per token as their TeacherMix says, mixture or routing
(framework/slice_teachers.py), so a multi-teacher job needs no whole logits either.
"""

from __future__ import annotations

from distillax.distill.multi_teacher import TEACHER_INDEX, TeacherMix, TeacherSet
from distillax.errors import ConfigError
from distillax.framework import losses, slice_teachers


def sliced_teacher(teacher_model, hidden_BxLxD, teachers: TeacherMix | None, batch):
  """(the teacher as token_sums takes it, its flat input or None): a Head and its input, or a
  slice_teachers.Teachers of each member's head and its share of the set's concatenated hidden
  states."""
  if not isinstance(teacher_model, TeacherSet):
    return losses.sliced_head(teacher_model, hidden_BxLxD)
  if teachers is None:
    raise ValueError("a TeacherSet's fold comes from its TeacherMix (`teachers`)")
  heads, inputs, start = [], [], 0
  for member, dim in zip(teacher_model.teachers, teacher_model.dims):
    head, h_NxD = losses.sliced_head(member, hidden_BxLxD[..., start:start + dim])
    heads.append(head)
    inputs.append(h_NxD)
    start += dim
  index_N = None
  if teachers.mode == "routing":
    if TEACHER_INDEX not in batch:
      raise ConfigError(f"distill.teachers_mode='routing' needs the batch's {TEACHER_INDEX} "
                        f"(each record's teacher); the data gave none")
    index_N = losses.flat_tokens(batch[TEACHER_INDEX])
  return slice_teachers.Teachers(tuple(heads), tuple(inputs), teachers.mode, teachers.weights,
                                 float(teachers.temperature), index_N), None
