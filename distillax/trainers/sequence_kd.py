"""Sequence-level distillation as a recipe: next-token training on text the teacher writes.

Before training, the teacher (loaded like every distillation teacher, then dropped) continues
train-document prompts and the samples go to `<workdir>/teacher_samples.jsonl` (or
`sequence_kd.output`); the train data is that file, eval stays on the validation split of
`data.source`. A finished sample file is reused on resume, so a restarted run trains on the same
data. The generation itself is distill/sequence_kd.py.
"""

from __future__ import annotations

import os

import jax
import ml_collections
from absl import logging

from distillax.data import make_train_iterator
from distillax.distill.sequence_kd import generate_samples, take_prompt_records, write_jsonl
from distillax.errors import ConfigError, UserError
from distillax.trainers import sources as src
from distillax.trainers.lm import LMRecipe
from distillax.trainers.registry import register

SAMPLES_FILE = "teacher_samples.jsonl"


@register("sequence_kd")
class SequenceKDRecipe(LMRecipe):
  """The `lm` recipe whose train data are teacher samples it writes first."""

  data_splits = ("eval",)  # data's train split holds prompts: answers are the teacher's

  def __init__(self, config, **kwargs):
    super().__init__(config, **kwargs)
    sc = config.sequence_kd
    for name in ("num_prompts", "prompt_len", "batch_size"):
      if int(sc[name]) < 1:
        raise ConfigError(f"sequence_kd.{name}={sc[name]} must be >= 1")
    # Checked up front; loaded (then dropped) only to write the samples.
    self.teacher_source, self.teacher_config = src.job_teacher(config, self.sources,
                                                               self.model_config.vocab_size)

  @property
  def samples_path(self) -> str:
    if self.config.sequence_kd.output:
      return os.path.abspath(self.config.sequence_kd.output)
    if not self.workdir:
      raise UserError("sequence_kd needs a workdir for its samples, or sequence_kd.output")
    return os.path.join(os.path.abspath(self.workdir), SAMPLES_FILE)

  def samples_data_config(self) -> ml_collections.ConfigDict:
    """The `data` section with the sample file as the whole train set, read in the layout
    the samples are written in (distill/sequence_kd.py: text, or prompt and completion per
    record), whatever layout and fields `data` names for the original source."""
    data = ml_collections.ConfigDict(self.config.data.to_dict())
    data.source, data.format, data.layout = self.samples_path, "jsonl", "auto"
    data.text_field, data.messages_field = "text", "messages"
    data.eval_source, data.validation_fraction = "", 0.0
    return data

  def train_iterator(self):
    self.ensure_samples()
    return make_train_iterator(self.samples_data_config(), global_batch_size=self.batch_size,
                               seq_len=self.seq_len, seed=int(self.config.seed),
                               tokenizer=self.tokenizer)

  def ensure_samples(self) -> str:
    """Writes the teacher samples unless a finished file is already there; returns its path."""
    path, sc = self.samples_path, self.config.sequence_kd
    if os.path.exists(path):
      logging.info("sequence_kd: reusing the teacher samples in %s", path)
      return path
    if jax.process_count() > 1:
      raise UserError("sequence_kd generates its samples in one process; run it without "
                      "--num_processes, or generate once and train the lm config on the file")
    teacher = self.teacher_source.load(self.teacher_config, self.mesh, self.rules,
                                       seed=int(self.config.seed))
    prompts = take_prompt_records(self.config.data, self.tokenizer, count=int(sc.num_prompts),
                                  prompt_len=int(sc.prompt_len), seed=int(self.config.seed))
    samples, stats = generate_samples(teacher, prompts, self.tokenizer, sc, mesh=self.mesh,
                                      rules=self.rules, seed=int(self.config.seed))
    write_jsonl(path, samples)
    logging.info("sequence_kd: %d teacher samples (%d generated tokens, teacher NLL %.3f per "
                 "token) in %s", stats["samples"], stats["generated_tokens"],
                 stats["teacher_nll_per_token"], path)
    return path
