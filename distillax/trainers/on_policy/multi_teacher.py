"""On-policy distillation from several teachers: the on-policy recipe over the several-teacher
recipe (`trainer='on_policy_multi_teacher'`, configs/distill_multi_teacher.py with its
`on_policy` argument).

The student samples on the mesh as in recipe.py; its completions are graded by the `teachers`
folded as `distill.teachers_mode` says (distill/on_policy/objective.py): mixture, the weighted mixture of
the teachers' distributions at the divergence's temperature; routing, each prompt's own teacher,
the one its data source's `distill.routes` entry names. Routed prompts come from every route's
source in turn (one from each, round after round), each with its teacher's index
(PROMPT_TEACHER); held-out prompts likewise, so the eval figure grades each by its teacher.
"""

from __future__ import annotations

import jax
import numpy as np

from distillax.distill.multi_teacher import teacher_set
from distillax.distill.on_policy.objective import PROMPT_TEACHER
from distillax.distill.sequence_kd import take_prompt_records
from distillax.errors import ConfigError, UserError
from distillax.framework import flops
from distillax.trainers.distill.multi_teacher import MultiTeacherDistillRecipe
from distillax.trainers.on_policy.recipe import OnPolicyRecipe
from distillax.trainers.on_policy.parts import OnPolicyIterator
from distillax.trainers.registry import register
from distillax.trainers.routed_data import route_data


class RoutedPromptIterator(OnPolicyIterator):
  """OnPolicyIterator whose rows also carry their prompt's teacher index (PROMPT_TEACHER)."""

  def __init__(self, packed, prompts, teachers, **kwargs):
    super().__init__(packed, prompts, **kwargs)
    self.teachers = np.asarray(teachers, np.int32)

  def __next__(self):
    start = self.position * self.global_batch + self.first
    batch = super().__next__()
    rows = (start + np.arange(self.local)) % len(self.teachers)
    batch[PROMPT_TEACHER] = self.teachers[rows]
    return batch


@register("on_policy_multi_teacher")
class MultiTeacherOnPolicyRecipe(OnPolicyRecipe, MultiTeacherDistillRecipe):
  """The student learns from its own samples, graded by several teachers (mixed or routed)."""

  def __init__(self, config, **kwargs):
    self._routed_prompts = {}
    super().__init__(config, **kwargs)
    if self.cache is not None:
      raise ConfigError(f"{self.cache.source.named()}: on-policy teachers grade the student's "
                        f"own samples, which no cache holds; name that teacher's workdir or "
                        f"hf_path instead")

  def eval_teacher(self, extras):
    return teacher_set(extras, self.mix, self.model_config.vocab_size)

  def _routed(self, split: str):
    """(prompts, teacher indices) of `split`, one route's prompt after another's in turn."""
    if split not in self._routed_prompts:
      per_route = []
      for source, index in self.routes:
        data = route_data(self.config.data, source)
        per_route.append((self._prompts_of(data, split, len(self.routes)), index))
      prompts, teachers = [], []
      for i in range(max(len(p) for p, _ in per_route)):
        for p, index in per_route:
          if i < len(p):
            prompts.append(p[i])
            teachers.append(index)
      self._routed_prompts[split] = (prompts, teachers)
    return self._routed_prompts[split]

  def _prompts_of(self, data, split: str, routes: int) -> list:
    """Each route's share of the prompts, from its own data source."""
    c = self.config.on_policy
    count = -(-int(c.num_prompts if split == "train" else c.eval_prompts) // routes)
    try:
      records = take_prompt_records(data, self.tokenizer, count=count,
                                    prompt_len=self.prompt_len, seed=int(self.config.seed),
                                    split=split, field="on_policy.prompt_len")
    except UserError as e:
      raise UserError(f"on_policy: {e}") from None
    return [r.tokens for r in records]

  def prompts(self, split: str = "train") -> list:
    if self.routes is None:
      return super().prompts(split)
    return self._routed(split)[0]

  def prompt_teachers(self, split: str):
    return None if self.routes is None else self._routed(split)[1]

  def train_iterator(self):
    if self.routes is None:
      return super().train_iterator()
    return RoutedPromptIterator(MultiTeacherDistillRecipe.train_iterator(self),
                                self.prompts("train"), self.prompt_teachers("train"),
                                global_batch=self.batch_size, width=self.prompt_len,
                                pad_id=self.tokenizer.pad_id, process_index=jax.process_index(),
                                process_count=jax.process_count())

  def prompt_shapes(self) -> dict:
    shapes = super().prompt_shapes()
    if self.routes is not None:
      shapes[PROMPT_TEACHER] = jax.ShapeDtypeStruct((self.batch_size,), np.int32)
    return shapes

  def step_flops(self) -> float:
    """The one-teacher on-policy step's, plus the other teachers' scoring forwards."""
    n = self.batch_size * self.settings.num_samples
    length = self.prompt_len + self.settings.max_new_tokens - 1
    return super().step_flops() + sum(flops.forward_flops(t.model_config, n, length)
                                      for t in self.teachers[1:])


__all__ = ["MultiTeacherOnPolicyRecipe", "RoutedPromptIterator"]
