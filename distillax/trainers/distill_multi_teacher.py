"""Distillation from several teachers (the `teachers` list): the distillation recipe with every
teacher a frozen extra of its own (`teacher:<name>`, sharded by the rules like the one teacher,
listed one by one by `plan`), folded into one KD target inside the step by
`distill.teachers_mode` (distill/multi_teacher.py): 'mixture' (sum_i w_i softmax(t_i / T)) or
'routing' (each record's own teacher, from the batch's teacher index).

Checkpoints hold no teacher: each is reloaded from its source on resume and checked by
fingerprint (saved.py); `teachers.json` in the workdir records name, weight, source and
fingerprint of each.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from distillax.distill import make_distill_objective
from distillax.distill.multi_teacher import TEACHER_INDEX, TeacherMix, teacher_key
from distillax.errors import ConfigError
from distillax.framework import flops
from distillax.framework.step import Objective
from distillax.models.init import abstract_model
from distillax.trainers.distill import DistillRecipe
from distillax.trainers.registry import register
from distillax.trainers.routed_data import (parse_routes, routed_eval_iterator,
                                            routed_train_iterator)
from distillax.trainers.sources.teachers import absolute_teacher_paths, job_teachers

MANIFEST = "teachers.json"  # in the workdir: the teachers a run distils from


@register("distill_multi_teacher")
class MultiTeacherDistillRecipe(DistillRecipe):
  """`trainer='distill_multi_teacher'`: LogitKD against several teachers at once."""

  def __init__(self, config, **kwargs):
    super().__init__(absolute_teacher_paths(config), **kwargs)

  def step_teacher(self):
    """The first teacher stands for `teacher_model_config` (the strategy's shapes); all of them
    are `self.teachers`."""
    self.teachers = job_teachers(self.config, self.sources.student, self.model_config.vocab_size)
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
    return None, self.teachers[0].model_config

  @property
  def teacher_sources(self) -> dict:
    """{extras key: source} of every teacher: what a save fingerprints and a resume reloads."""
    return {teacher_key(t.name): t.source for t in self.teachers}

  def objective(self, *, train: bool = False) -> Objective:
    objective = make_distill_objective(self.strategy(), chunk_size=self.chunk_size(),
                                       metrics=not train, teachers=self.mix,
                                       router_loss_weights=self.router_loss_weights(train))
    return self.transforms.train_objective(objective) if train else objective

  def step_flops(self) -> float:
    """The student's step and every teacher's forward."""
    return (flops.train_step_flops(self.model_config, self.batch_size, self.seq_len)["total"]
            + sum(flops.forward_flops(t.model_config, self.batch_size, self.seq_len)
                  for t in self.teachers))

  def build(self, *, abstract: bool, quantize: bool = True):
    student = self.wrap_student(self.build_student(abstract=abstract, quantize=quantize),
                                abstract=abstract)
    seed = int(self.config.seed)
    if abstract:
      return student, {teacher_key(t.name): abstract_model(t.model_config, seed)
                       for t in self.teachers}
    self.write_manifest()
    return student, {teacher_key(t.name): t.source.load(t.model_config, self.mesh, self.rules,
                                                        seed=seed)
                     for t in self.teachers}

  def batch_shapes(self):
    shapes = dict(super().batch_shapes())
    if self.routes is not None:
      shapes[TEACHER_INDEX] = jax.ShapeDtypeStruct((self.batch_size, self.seq_len), jnp.int32)
    return shapes

  def train_iterator(self):
    if self.routes is None:
      return super().train_iterator()
    c = self.config
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
