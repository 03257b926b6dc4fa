"""Distillation from several teachers (the `teachers` list): the distillation recipe with every
teacher a frozen extra of its own (`teacher:<name>`, sharded by the rules like the one teacher,
listed one by one by `plan`), folded into one KD target inside the step by
`distill.teachers_mode` (distill/multi_teacher.py): 'mixture' (sum_i w_i softmax(t_i / T)) or
'routing' (each record's own teacher, from the batch's teacher index).

Checkpoints hold no teacher: each is reloaded from its source on resume and checked by
fingerprint (saved.py); `teachers.json` in the workdir records name, weight, source and
fingerprint of each.

One teacher may be a hidden-state cache (`teachers[i].cache_dir`): its LM head is its frozen
extra, and the cache's rows are the train batches (TEACHER_HIDDEN with them), on which the live
teachers run; routed, they are the rows of the route naming that teacher (its source's
validation split still evaluates it). Eval batches carry no cached states, so eval reports the
student's hard-label CE, as training from one cache does (training_from_cache.py).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from distillax.distill import make_distill_objective
from distillax.distill.multi_teacher import TEACHER_INDEX, TeacherMix, teacher_key
from distillax.distill.teacher_head import TEACHER_HIDDEN
from distillax.distill.training_from_cache import cached_batch_shapes, cached_objective
from distillax.errors import ConfigError
from distillax.framework import flops
from distillax.framework.step import Objective
from distillax.models.init import abstract_model
from distillax.trainers.distill.recipe import DistillRecipe
from distillax.trainers.registry import register
from distillax.trainers.routed_data import (parse_routes, routed_eval_iterator,
                                            routed_train_iterator, train_iterator_with_cache)
from distillax.trainers.sources.teachers import absolute_teacher_paths, job_teachers

MANIFEST = "teachers.json"  # in the workdir: the teachers a run distils from


@register("distill_multi_teacher")
class MultiTeacherDistillRecipe(DistillRecipe):
  """`trainer='distill_multi_teacher'`: LogitKD against several teachers at once."""

  sliced_loss = True  # its LogitKDs from the teachers folded over vocabulary slices
  def __init__(self, config, **kwargs):
    super().__init__(absolute_teacher_paths(config), **kwargs)

  def step_teacher(self):
    """The first teacher stands for `teacher_model_config` (the strategy's shapes); all of them
    are `self.teachers`."""
    self.teachers = job_teachers(self.config, self.sources.student, self.model_config.vocab_size)
    self.cache = next((t for t in self.teachers if t.cached), None)
    if self.cache is not None and self.cache.writer is not None:
      self.cache.source.check_teacher(self.config.teachers[self.teachers.index(self.cache)],
                                      self.cache.writer, self.model_config.vocab_size,
                                      self.mesh, self.rules, seed=int(self.config.seed))
    self.mix = TeacherMix(tuple(t.name for t in self.teachers),
                          str(self.config.distill.teachers_mode),
                          tuple(t.weight for t in self.teachers),
                          temperature=float(self.config.distill.logit.temperature))
    self.routes = None
    if self.mix.mode == "routing":
      self.routes = parse_routes(self.config.distill.get("routes", ()), self.mix)
      if self.config.data.eval_source:
        raise ConfigError(f"data.eval_source={self.config.data.eval_source!r}: routing evaluates "
                          f"each distill.routes source's own validation split (its teacher "
                          f"known); clear data.eval_source")
    return None, next(t.model_config for t in self.teachers if not t.cached)

  @property
  def teacher_sources(self) -> dict:
    """{extras key: source} of every teacher: what a save fingerprints and a resume reloads."""
    return {teacher_key(t.name): t.source for t in self.teachers}

  def objective(self, *, train: bool = False) -> Objective:
    make = make_distill_objective if self.cache is None else cached_objective
    sliced = self.loss_impl == "sliced" and (
        self.config.train.get("loss_impl", "auto") == "sliced" or self.sliced_strategy())
    objective = make(self.strategy(), chunk_size=self.chunk_size(), metrics=not train,
                     teachers=self.mix, router_loss_weights=self.router_loss_weights(train),
                     sliced=sliced)
    return self.transforms.train_objective(objective) if train else objective

  def step_flops(self) -> float:
    """The student's step and every teacher's forward."""
    return (flops.train_step_flops(self.model_config, self.batch_size, self.seq_len)["total"]
            + sum(flops.forward_flops(t.model_config, self.batch_size, self.seq_len)
                  for t in self.teachers if not t.cached))

  def build(self, *, abstract: bool, quantize: bool = True):
    student = self.wrap_student(self.build_student(abstract=abstract, quantize=quantize),
                                abstract=abstract)
    if not abstract:
      self.write_manifest()
    return student, {teacher_key(t.name): self._teacher(t, abstract) for t in self.teachers}

  def _teacher(self, t, abstract: bool):
    """One teacher's frozen extra: its model, or a cache's LM head."""
    if t.cached:
      return t.source.abstract() if abstract else t.source.load(self.mesh, self.rules)
    if abstract:
      return abstract_model(t.model_config, int(self.config.seed))
    return t.source.load(t.model_config, self.mesh, self.rules, seed=int(self.config.seed))

  def batch_shapes(self):
    shapes = dict(super().batch_shapes())
    if self.routes is not None:
      shapes[TEACHER_INDEX] = jax.ShapeDtypeStruct((self.batch_size, self.seq_len), jnp.int32)
    if self.cache is not None:
      shapes[TEACHER_HIDDEN] = cached_batch_shapes(self.cache.source.cache_dir, self.batch_size,
                                                   self.seq_len)[TEACHER_HIDDEN]
    return shapes

  def train_iterator(self):
    c = self.config
    if self.cache is not None:
      return train_iterator_with_cache(
          c.data, self.routes, self.cache.source.cache_dir, self.teachers.index(self.cache),
          self.batch_shapes()[TEACHER_HIDDEN], global_batch_size=self.batch_size,
          seq_len=self.seq_len, seed=int(c.seed), tokenizer=self.tokenizer)
    if self.routes is None:
      return super().train_iterator()
    return routed_train_iterator(c.data, self.routes, global_batch_size=self.batch_size,
                                 seq_len=self.seq_len, seed=int(c.seed), tokenizer=self.tokenizer)

  def eval_iterator(self):
    if self.routes is None:
      return super().eval_iterator()
    c = self.config
    return routed_eval_iterator(c.data, self.routes, global_batch_size=self.batch_size,
                                seq_len=self.seq_len, num_batches=int(c.train.eval_batches),
                                tokenizer=self.tokenizer)

  def load_teacher(self):
    """One teacher alone (what cache-teacher writes a cache of): not this job's to choose."""
    raise ConfigError("a teacher cache holds one teacher; write each teacher's with "
                      "configs/distill.py and --config.teacher.workdir (or hf_path) naming it")

  def write_manifest(self) -> None:
    """`teachers.json`: name, weight, source and fingerprint of each teacher, in index order
    (the index a routed record's teacher has in the batch)."""
    if not self.workdir or jax.process_index() != 0:
      return
    os.makedirs(self.workdir, exist_ok=True)
    manifest = {"mode": self.mix.mode, "teachers": [t.manifest() for t in self.teachers]}
    with open(os.path.join(self.workdir, MANIFEST), "w") as f:
      json.dump(manifest, f, indent=1, allow_nan=False)
