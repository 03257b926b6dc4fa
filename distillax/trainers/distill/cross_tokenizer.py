"""Distillation from a teacher with another tokenizer (`distill.objective='cross_tokenizer'`).

The distillation recipe with three differences: the teacher's tokenizer (teacher.tokenizer, or
its checkpoint's) sizes a preset teacher and cuts every text a second time; the batches are
cross-tokenizer rows (data.cross_tokenizer_rows: both tokenizations and their byte alignment,
built per document in the grain pipeline, one document window per row, not packed); and the
objective is distill.cross_tokenizer_objective, not the `distill` section's strategies.
"""

from __future__ import annotations

import jax
import numpy as np

from distillax.data import make_tokenizer, padded_vocab_size
from distillax.data.cross_tokenizer import rows
from distillax.data.cross_tokenizer.pipeline import (make_cross_tokenizer_eval_iterator,
                                                     make_cross_tokenizer_train_iterator)
from distillax.data.cross_tokenizer.token_bytes import shared_vocab, token_byte_strings
from distillax.distill.cross_tokenizer.objective import make_cross_tokenizer_objective
from distillax.errors import ConfigError, UserError
from distillax.framework.step import Objective
from distillax.trainers import sources as src
from distillax.trainers.distill.recipe import DistillRecipe
from distillax.trainers.registry import register
from distillax.trainers.sources import vocabulary


@register("distill_cross_tokenizer")
class CrossTokenizerDistillRecipe(DistillRecipe):
  """`trainer='distill'` with `distill.objective='cross_tokenizer'`."""

  sliced_loss = False  # its objective is not make_distill_objective's one LogitKD
  router_losses = False  # the cross-tokenizer objective adds none yet

  def __init__(self, config, **kwargs):
    super().__init__(config, **kwargs)
    rows.check_text_layout(str(self.config.data.layout))

  def step_teacher(self):
    spec = vocabulary.teacher_tokenizer_spec(self.config, self.sources.teacher)
    try:
      self.teacher_tokenizer = make_tokenizer(spec)
    except UserError as e:
      raise type(e)(f"teacher.tokenizer={spec!r}: {e}") from None
    for field, tokenizer in ((f"data.tokenizer={self.config.data.tokenizer!r}", self.tokenizer),
                             (f"teacher.tokenizer={spec!r}", self.teacher_tokenizer)):
      try:
        token_byte_strings(tokenizer)  # the byte spelling of every id, which alignment needs
      except ConfigError as e:
        raise ConfigError(f"{field}: {e}") from None
    teacher = self.sources.step_teacher
    if teacher is None:
      raise ConfigError("distill.objective='cross_tokenizer' needs a teacher model; name "
                        "teacher.workdir, hf_path or preset")
    vocab = (padded_vocab_size(self.teacher_tokenizer) if teacher.kind == "fresh"
             else teacher.model_config().vocab_size)
    if teacher.kind == "fresh":
      teacher = src.teacher_source(self.config.teacher, vocab)
    cfg = src.teacher_model_config(self.config.teacher, teacher, vocab, attention_impl=(
        self.config.model.get("attention_impl", "auto")))
    if cfg.vocab_size < self.teacher_tokenizer.vocab_size:
      raise ConfigError(f"the teacher ({teacher.named()}) has vocab_size={cfg.vocab_size}, fewer "
                        f"than the {self.teacher_tokenizer.vocab_size} ids of teacher.tokenizer="
                        f"{spec!r}; name the teacher's own tokenizer")
    section = self.config.distill.cross_tokenizer
    self.teacher_seq_len = int(section.teacher_seq_len) or self.seq_len
    if self.teacher_seq_len < 1:
      raise ConfigError(f"distill.cross_tokenizer.teacher_seq_len={section.teacher_seq_len} "
                        f"must be >= 0 (0 = train.seq_len)")
    self.teacher_to_student_Vt, self.shared_ids = self._shared_ids(spec, cfg.vocab_size)
    return teacher, cfg

  def _shared_ids(self, spec: str, teacher_vocab: int):
    """(teacher id -> student id map, (student ids, teacher ids) of the shared vocabulary). One
    tokenizer on both sides shares every id of the models' vocabulary, padding ids too."""
    student_vocab = self.model_config.vocab_size
    if spec == str(self.config.data.tokenizer) and teacher_vocab == student_vocab:
      ids = np.arange(student_vocab, dtype=np.int32)
      return ids, (ids, ids)
    shared = shared_vocab(self.tokenizer, self.teacher_tokenizer)
    return shared.teacher_to_student_Vt, (shared.student_ids_S, shared.teacher_ids_S)

  def objective(self, *, train: bool = False) -> Objective:
    c = self.config.distill.cross_tokenizer
    objective = make_cross_tokenizer_objective(
        *self.shared_ids, temperature=float(c.temperature), alpha=float(c.alpha),
        exact_weight=float(c.exact_weight), span_weight=float(c.span_weight),
        uld_weight=float(c.uld_weight), chunk_size=self.chunk_size())
    return self.transforms.train_objective(objective) if train else objective

  def strategy(self):
    return None  # the student carries no strategy projections

  def batch_shapes(self):
    return {key: jax.ShapeDtypeStruct((self.batch_size, length), dtype)
            for key, (length, dtype) in rows.row_shapes(self.seq_len,
                                                        self.teacher_seq_len).items()}

  def _data_kwargs(self) -> dict:
    return dict(global_batch_size=self.batch_size, seq_len=self.seq_len,
                teacher_seq_len=self.teacher_seq_len, student=self.tokenizer,
                teacher=self.teacher_tokenizer, teacher_to_student_Vt=self.teacher_to_student_Vt)

  def train_iterator(self):
    return make_cross_tokenizer_train_iterator(self.config.data, seed=int(self.config.seed),
                                               **self._data_kwargs())

  def eval_iterator(self):
    return make_cross_tokenizer_eval_iterator(
        self.config.data, num_batches=int(self.config.train.eval_batches), **self._data_kwargs())
