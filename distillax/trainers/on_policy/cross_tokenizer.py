"""On-policy distillation from a teacher with another tokenizer (`trainer='on_policy'` with
`distill.objective='cross_tokenizer'`; configs/distill_cross_tokenizer.py:on_policy).

The cross-tokenizer recipe (teacher tokenizer, shared vocabulary, the loss and its validation
rows) with on-policy's prompts and sampling settings (the `on_policy` section). Each step the
student samples on the mesh, the host builds the teacher's tokens of the samples' text and the
byte alignment (data.cross_tokenizer_samples), and the step trains the cross-tokenizer loss on
the student's own completions (distill.cross_tokenizer_on_policy; the runner that puts the host
between the two programs: trainers/on_policy/host_step.py). Eval reports the cross-tokenizer
loss on the validation rows, as the off-policy job does.

Not built yet: lmbda < 1 (mixing in the data's rows) and on-policy eval figures (the reverse KL
of held-out completions needs one vocabulary).
"""

from __future__ import annotations

import jax
import numpy as np

from distillax import quant
from distillax.data.cross_tokenizer.samples import SampleAligner
from distillax.distill.cross_tokenizer.on_policy import (COMPLETION_LENGTHS, COMPLETION_TOKENS,
                                                         make_cross_tokenizer_on_policy_objective)
from distillax.distill.on_policy.objective import PROMPT_LENGTHS, PROMPT_TOKENS, ROW_IDS
from distillax.errors import ConfigError
from distillax.framework.step import Objective
from distillax.trainers.distill.recipe import DistillRecipe
from distillax.trainers.distill.cross_tokenizer import CrossTokenizerDistillRecipe
from distillax.trainers.on_policy.recipe import (OnPolicyRecipe, micro_batches, sample_width,
                                                 settings_from_config)
from distillax.trainers.on_policy.host_step import HostStep
from distillax.trainers.on_policy.parts import OnPolicyIterator
from distillax.trainers.recipe import Recipe
from distillax.trainers.registry import register
from distillax.trainers.sources import vocabulary


class _NoRows:
  """The data side of an lmbda = 1 job: the steps read prompts only."""

  def __next__(self) -> dict:
    return {}

  def get_state(self) -> dict:
    return {}

  def set_state(self, state: dict) -> None:
    del state


@register("on_policy_cross_tokenizer")
class CrossTokenizerOnPolicyRecipe(CrossTokenizerDistillRecipe):
  """The student learns from its own samples, graded by a teacher of another tokenizer."""

  rollback_metrics = DistillRecipe.rollback_metrics
  prompts = OnPolicyRecipe.prompts
  step_flops = OnPolicyRecipe.step_flops

  def __init__(self, config, **kwargs):
    super().__init__(config, **kwargs)
    c = config.on_policy
    self.settings = settings_from_config(c, self.tokenizer)
    if self.settings.lmbda != 1.0:
      raise ConfigError(f"on_policy.lmbda={c.lmbda}: cross-tokenizer on-policy trains on the "
                        f"student's samples only; use --config.on_policy.lmbda=1 (or the "
                        f"off-policy job, trainer='distill')")
    self.prompt_len = int(c.prompt_len)
    width = sample_width(self.prompt_len, self.settings, self.model_config)
    self.accum_steps = micro_batches(self.batch_size * self.settings.num_samples,
                                     self.settings.num_samples, int(c.get("micro_batch", 0)),
                                     int(config.train.accum_steps))
    # The teacher's tokens of one sample; by default as many as the student's scoring inputs.
    self.teacher_len = int(config.distill.cross_tokenizer.teacher_seq_len) or width - 1
    if self.teacher_len + 1 > self.teacher_model_config.max_seq_len:
      raise ConfigError(f"distill.cross_tokenizer.teacher_seq_len={self.teacher_len} exceeds the "
                        f"teacher's max_seq_len={self.teacher_model_config.max_seq_len}; "
                        f"set it lower")
    spec = vocabulary.teacher_tokenizer_spec(config, self.sources.teacher)
    self.aligner = SampleAligner(
        self.tokenizer, self.teacher_tokenizer, self.teacher_to_student_Vt,
        prompt_width=self.prompt_len, new_tokens=self.settings.max_new_tokens,
        teacher_len=self.teacher_len, same_tokenizer=spec == str(config.data.tokenizer))

  def objective(self, *, train: bool = False) -> Objective:
    """Train: the cross-tokenizer loss on the step's samples; eval: on the validation rows."""
    cross = super().objective(train=False)
    if not train:
      return cross
    return self.transforms.train_objective(
        make_cross_tokenizer_on_policy_objective(cross, self.settings))

  def batch_shapes(self):
    B, S, i32 = self.batch_size, self.settings.num_samples, np.dtype(np.int32)
    shapes = {PROMPT_TOKENS: ((self.prompt_len,), i32), PROMPT_LENGTHS: ((), i32),
              ROW_IDS: ((), i32), COMPLETION_TOKENS: ((S, self.settings.max_new_tokens), i32),
              COMPLETION_LENGTHS: ((S,), i32), **self.aligner.shapes(S)}
    return {k: jax.ShapeDtypeStruct((B,) + shape, dtype) for k, (shape, dtype) in shapes.items()}

  def train_iterator(self):
    return OnPolicyIterator(_NoRows(), self.prompts("train"), global_batch=self.batch_size,
                            width=self.prompt_len, pad_id=self.tokenizer.pad_id,
                            process_index=jax.process_index(),
                            process_count=jax.process_count())

  def build_engines(self, learning_rate: float | None = None, *, compile_now: bool = True):
    engines = Recipe.build_engines(self, learning_rate, compile_now=compile_now)
    return engines.wrap(self._host_step_engine)

  def _host_step_engine(self, engine):
    # Adapter dropout is for the learner's forward, not for sampling.
    context = (lambda: quant.lora_dropout(None)) if self.transforms.lora is not None else None
    engine.runner = HostStep(engine, self.settings, self.aligner,
                             sampling_context=context).runner()
    return engine
