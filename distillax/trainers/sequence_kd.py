"""Sequence-level distillation as a recipe: next-token training on text the teacher writes.

Before training, the teacher (loaded like every distillation teacher, then dropped) continues
train-document prompts and the samples go to `<workdir>/teacher_samples.jsonl` (or
`sequence_kd.output`); the train data is that file, eval stays on the validation split of
`data.source`. A finished sample file is reused on resume, so a restarted run trains on the same
data (trainers/teacher_samples.py, which the draft job's regeneration shares). The generation
itself is distill/sequence_kd.py.
"""

from __future__ import annotations

from distillax.trainers import sources as src
from distillax.trainers.lm import LMRecipe
from distillax.trainers.registry import register
from distillax.trainers.teacher_samples import TeacherSamples, check_sample_settings


@register("sequence_kd")
class SequenceKDRecipe(LMRecipe):
  """The `lm` recipe whose train data are teacher samples it writes first."""

  data_splits = ("eval",)  # data's train split holds prompts: answers are the teacher's

  def __init__(self, config, **kwargs):
    super().__init__(config, **kwargs)
    # Checked up front; loaded (then dropped) only to write the samples.
    self.teacher_source, self.teacher_config = src.job_teacher(config, self.sources,
                                                               self.model_config.vocab_size)
    check_sample_settings(config.sequence_kd, self.teacher_config, "trainer='sequence_kd'")
    self.samples = TeacherSamples(self)
    self.samples.check_existing()

  def train_iterator(self):
    return self.samples.train_iterator(self._load_teacher)

  def _load_teacher(self):
    return self.teacher_source.load(self.teacher_config, self.mesh, self.rules,
                                    seed=int(self.config.seed))
