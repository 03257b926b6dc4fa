"""Distillation recipes: the student learns from a frozen teacher that runs inside the step.

The `distill` section names the strategies (LogitKD, attention transfer, feature pooling and
projection) by weight; the `teacher` section names where the teacher comes from (teacher.py).
"""

from __future__ import annotations

import os

from flax import nnx

from distillax.distill import (TEACHER, AttentionTransfer, DistillStudent, FeaturePooling,
                               FeatureProjection, LogitKD, RouterKD, Strategy,
                               make_distill_objective, unwrap_student)
from distillax.distill.logit_kd import sliced_leaves
from distillax.framework.vocab_chunks import chunk_size_from_config
from distillax.errors import ConfigError
from distillax.framework.step import Objective
from distillax.models.config import TransformerConfig
from distillax.trainers import sources as src
from distillax.trainers.recipe import Recipe
from distillax.trainers.registry import register


def parse_layer_map(spec, student_layers: int, teacher_layers: int, *, hidden: bool):
  """'auto' maps each student layer to the teacher layer at the same relative depth."""
  if spec in ("", "auto", None):
    if hidden:  # hidden-state indices 1..L (0 is the embedding output)
      return {s: round(s * teacher_layers / student_layers) for s in range(1, student_layers + 1)}
    return {s: round((s + 1) * teacher_layers / student_layers) - 1
            for s in range(student_layers)}
  try:
    pairs = [p.split(":") for p in str(spec).replace(" ", "").split(",") if p]
    return {int(a): int(b) for a, b in pairs}
  except ValueError:
    raise ConfigError(f"layer_map={spec!r} is not 'auto' or 'student:teacher,...' pairs of "
                      f"layer indices, e.g. '1:2,3:6'") from None


def router_kd(c, student: TransformerConfig, teacher: TransformerConfig,
              source: src.ModelSource) -> RouterKD:
  """RouterKD with the layer and expert maps of the student's source (a student of teacher
  blocks: block i is teacher layer layers[i], keeping its kept experts), checked here."""
  layer_map = experts = None
  if isinstance(source, src.BlocksSource):
    layer_map, experts = dict(enumerate(source.layers)), source.kept_experts()
  strategy = RouterKD(layer_map=layer_map, experts=experts, weight=c.router.weight)
  strategy.check_experts(student.num_layers, student.num_experts, teacher.num_layers,
                         teacher.num_experts)
  return strategy


def strategy_from_config(c, student: TransformerConfig, teacher: TransformerConfig,
                         source: src.ModelSource | None = None) -> Strategy:
  """The weighted sum of the strategies whose weight in the `distill` section is > 0
  (`source`: the student's, whose maps router distillation reads)."""
  terms = []
  if c.logit.weight > 0:
    terms.append(LogitKD(temperature=c.logit.temperature, alpha=c.logit.alpha,
                         divergence=c.logit.divergence, beta=c.logit.beta,
                         top_k=c.logit.top_k or None, weight=c.logit.weight))
  ls, lt = student.num_layers, teacher.num_layers
  for name, cls, hidden in (("attention", AttentionTransfer, False),
                            ("feature_pooling", FeaturePooling, True),
                            ("feature_projection", FeatureProjection, True)):
    section = c[name]
    if section.weight > 0:
      terms.append(cls(layer_map=parse_layer_map(section.layer_map, ls, lt, hidden=hidden),
                       loss=section.loss, weight=section.weight))
  if c.get("router") is not None and c.router.weight > 0:
    terms.append(router_kd(c, student, teacher, source))
  if not terms:
    raise ConfigError("every distill.*.weight is 0; give at least one strategy a weight, e.g. "
                      "--config.distill.logit.weight=1")
  strategy = terms[0]
  for t in terms[1:]:
    strategy = strategy + t
  return strategy


@register("distill")
class DistillRecipe(Recipe):
  """The student (wrapped with its training-only projections) against an online teacher."""

  student_path = ("model",)  # DistillStudent.model
  # The guard watches the distillation objective (its next-token CE is a part of it at most).
  rollback_metrics = ("eval_objective", "eval_loss", "eval_perplexity")
  router_losses = True  # an MoE student's, next to the distillation terms
  mix = None  # several teachers' TeacherMix (multi_teacher.py); None: one teacher
  sliced_loss = True  # train.loss_impl='sliced': its LogitKDs (sliced_strategy says which)

  def __init__(self, config, **kwargs):
    super().__init__(config, **kwargs)
    self.teacher_source, self.teacher_model_config = self.step_teacher()

  def step_teacher(self):
    """(source, model config) of the teacher run in the step; a preset teacher takes the
    student's vocabulary."""
    return src.job_teacher(self.config, self.sources, self.model_config.vocab_size)

  def strategy(self) -> Strategy:
    return strategy_from_config(self.config.distill, self.model_config, self.teacher_model_config,
                                self.derived_from())

  def derived_from(self) -> src.ModelSource:
    """The student's source as RouterKD reads its layer and kept-expert maps. A run whose
    student was derived from teacher blocks is read back from its checkpoint, with
    student.from_teacher cleared (sources.as_loaded), so `eval` and `expert-load --model` of it
    take the maps from the run's config.json, as its training did."""
    source = self.sources.student
    if (isinstance(source, src.BlocksSource) or not self.workdir
        or not os.path.isfile(os.path.join(self.workdir, "config.json"))):
      return source
    derived = src.load_run_config(self.workdir).get("student", {}).get("from_teacher", {})
    layers = tuple(int(i) for i in (derived.get("layers") or ()))
    if not layers:
      return source
    return src.BlocksSource(self.teacher_source, layers,
                            experts=tuple(derived.get("experts") or ()))

  def objective(self, *, train: bool = False) -> Objective:
    """Train: the loss terms and hard_ce; eval adds the logit metrics that cost extra passes
    over the vocabulary (teacher_ce, top1_agreement, logit_cosine)."""
    asked = self.config.train.get("loss_impl", "auto")
    sliced = self.loss_impl == "sliced" and (asked == "sliced" or self.sliced_strategy())
    objective = make_distill_objective(self.strategy(), chunk_size=self.chunk_size(),
                                       metrics=not train, sliced=sliced,
                                       router_loss_weights=self.router_loss_weights(train),
                                       chunks_on_tpu=asked == "auto")
    return self.transforms.train_objective(objective) if train else objective

  def sliced_strategy(self) -> bool:
    """Whether the strategy's logit terms are ones vocabulary slices compute (one LogitKD, or
    several over the whole vocabulary: logit_kd.sliced_leaves): what train.loss_impl='auto'
    then runs; an explicit 'sliced' is refused otherwise."""
    try:
      sliced_leaves([(w, leaf) for w, leaf in self.strategy().leaves() if leaf.needs.logits],
                  self.mix)
    except ConfigError:
      return False
    return True

  def router_loss_weights(self, train: bool) -> tuple[float, float]:
    """(train.moe_aux_loss, train.router_z_loss) in training; eval objectives report the router
    losses unweighted, so eval_objective stays the distillation loss."""
    if not train:
      return (0.0, 0.0)
    return tuple(float(self.config.train.get(name, 0.0))
                 for name in ("moe_aux_loss", "router_z_loss"))

  def chunk_size(self) -> int | None:
    return chunk_size_from_config(self.config.distill.chunk_size)

  def load_teacher(self) -> nnx.Module:
    """The frozen teacher alone, sharded on this recipe's mesh (also for cache-teacher)."""
    if self.teacher_source is None:
      raise ConfigError("teacher.cache_dir is set, but this job runs the teacher itself; clear "
                        "--config.teacher.cache_dir and name teacher.workdir, hf_path or preset")
    return self.teacher_source.load(self.teacher_model_config, self.mesh, self.rules,
                                    seed=int(self.config.seed))

  def build(self, *, abstract: bool, quantize: bool = True):
    student = self.wrap_student(self.build_student(abstract=abstract, quantize=quantize),
                                abstract=abstract)
    if abstract:
      return student, {TEACHER: self.teacher_source.abstract(self.teacher_model_config,
                                                             int(self.config.seed))}
    return student, {TEACHER: self.load_teacher()}

  def wrap_student(self, model: nnx.Module, *, abstract: bool) -> nnx.Module:
    """The student with the strategy's learned projections (trained, never exported); none
    without a teacher model (a cache holds no features to project to)."""
    strategy = self.strategy() if self.teacher_model_config else None
    t_dim = self.teacher_model_config.embed_dim if self.teacher_model_config else None
    wrap = lambda: DistillStudent(model, strategy, teacher_embed_dim=t_dim,
                                  rngs=nnx.Rngs(int(self.config.seed) + 1),
                                  param_dtype=self.model_config.param_dtype)
    return nnx.eval_shape(wrap) if abstract else src.place(wrap(), self.mesh, self.rules)

  def export_model(self, student: nnx.Module) -> nnx.Module:
    return super().export_model(unwrap_student(student)[0])
