"""Distillation from an offline teacher cache: the distillation recipe with the teacher's
outputs read from disk instead of a teacher in the step. Only the objective, the batches and
their shapes differ; the engine is built exactly as for every other recipe (so LoRA dropout,
eval objectives and QAT apply here too).

A hidden-state cache (cache.kind='hidden') brings the teacher's LM head: it is the one frozen
extra (`extras['teacher']`, a TeacherHead from sources/cache_head.py, reloaded from the cache on
resume), and the step rebuilds the teacher's exact logits from it and the cached hidden states.
"""

from __future__ import annotations

from distillax.distill import TEACHER, read_cache_info
from distillax.distill.training_from_cache import (cached_batch_shapes, cached_objective,
                                                   cached_strategy, cached_train_iterator)
from distillax.errors import ConfigError
from distillax.framework.step import Objective
from distillax.trainers.distill.recipe import DistillRecipe
from distillax.trainers.registry import register
from distillax.trainers.sources.cache_head import CacheHeadSource


@register("distill_cached")
class CachedDistillRecipe(DistillRecipe):
  """`trainer='distill'` with `teacher.cache_dir` set."""

  sliced_loss = True  # a top-k cache's CachedLogitKD (any K), a hidden cache's LogitKD
  router_losses = True  # an MoE student's, on the cached train batches

  data_splits = ("eval",)  # the train batches come from the cache

  def __init__(self, config, **kwargs):
    super().__init__(config, **kwargs)
    self.cache_dir = str(self.config.teacher.cache_dir)
    self.cache_info = read_cache_info(self.cache_dir)
    self.hidden = self.cache_info.kind == "hidden"
    if self.config.get("cache") and self.config.cache.kind == "hidden" and not self.hidden:
      raise ConfigError(f"cache.kind='hidden', but teacher.cache_dir={self.cache_dir} holds a "
                        f"{self.cache_info.kind} cache; write a hidden-state cache with "
                        f"distillax cache-teacher --kind hidden, or drop --config.cache.kind")
    self.head_source = None
    if self.hidden:
      self.head_source = CacheHeadSource(self.cache_dir, self.cache_info.head_fingerprint)
      self.head_source.check_teacher(self.config.teacher, self.sources.teacher,
                                     self.model_config.vocab_size, self.mesh, self.rules,
                                     seed=int(self.config.seed))

  def strategy(self):
    return cached_strategy(self.config.distill, self.cache_info, self.model_config.vocab_size)

  def objective(self, *, train: bool = False) -> Objective:
    # metrics on in training too: the cache's teacher_ce and top-1 exist on train batches only
    sliced = self.loss_impl == "sliced" and (
        self.config.train.get("loss_impl", "auto") == "sliced" or self.sliced_strategy())
    objective = cached_objective(self.strategy(), chunk_size=self.chunk_size(), metrics=True,
                                 router_loss_weights=self.router_loss_weights(train),
                                 sliced=sliced)
    return self.transforms.train_objective(objective) if train else objective

  def build(self, *, abstract: bool, quantize: bool = True):
    student = self.build_student(abstract=abstract, quantize=quantize)
    extras = {}
    if self.head_source is not None:
      extras[TEACHER] = (self.head_source.abstract() if abstract
                         else self.head_source.load(self.mesh, self.rules))
    return self.wrap_student(student, abstract=abstract), extras

  def batch_shapes(self):
    return cached_batch_shapes(self.cache_dir, self.batch_size, self.seq_len)

  def train_iterator(self):
    return cached_train_iterator(self.cache_dir, global_batch_size=self.batch_size,
                                 seq_len=self.seq_len, seed=int(self.config.seed),
                                 temperature=float(self.config.distill.logit.temperature))
