"""Knowledge distillation: a frozen teacher runs inside the same compiled step as the student.

The teacher comes from a distillax run (`teacher.workdir`), a Hugging Face checkpoint
(`teacher.hf_path`) or, for tests, a preset with fresh weights (`teacher.model`). Both models are
sharded by the same rules on the same mesh, each with its own dtypes. The strategy is a weighted
sum of the configured terms (`distill.*.weight > 0`); see `distillax.distill` for each one.

With `teacher.cache_dir` (written by `distillax cache-teacher`) no teacher is loaded at all: the
strategy is CachedLogitKD, the batches come from the cache and eval is hard-label CE on the
validation split (distillax/distill/cache_job.py).
"""

from __future__ import annotations

import ml_collections
from flax import nnx

from distillax.distill import (AttentionTransfer, DistillStudent, FeaturePooling,
                               FeatureProjection, LogitKD, Strategy, make_distill_objective)
from distillax.distill.objective import TEACHER
from distillax.errors import ConfigError
from distillax.models.config import TransformerConfig
from distillax.models.init import abstract_model, create_model
from distillax.trainers.base import Trainer, place_module, resolve_model_config


def default_distill_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.chunk_size = 0  # tokens per logit chunk (student and teacher together); 0 = unchunked
  c.logit = ml_collections.ConfigDict()
  c.logit.weight = 1.0  # weight of LogitKD in the total loss (0 = off)
  c.logit.temperature = 2.0  # softmax temperature of both models
  c.logit.alpha = 0.7  # share of the soft (teacher) term; 1 - alpha goes to hard-label CE
  c.logit.divergence = "forward_kl"  # forward_kl | reverse_kl | jsd
  c.logit.beta = 0.5  # JSD mixing weight
  c.logit.top_k = 0  # compare over the teacher's top-k tokens (+ a rest bucket); 0 = full vocab
  c.attention = ml_collections.ConfigDict()
  c.attention.weight = 0.0  # AttentionTransfer weight (0 = off)
  c.attention.layer_map = "auto"  # "s:t,s:t" student->teacher block indices, or auto
  c.attention.loss = "kl"  # kl | mse
  c.feature_pooling = ml_collections.ConfigDict()
  c.feature_pooling.weight = 0.0  # FeaturePooling weight (0 = off)
  c.feature_pooling.layer_map = "auto"  # "s:t,..." hidden-state indices, or auto
  c.feature_pooling.loss = "cosine"  # cosine | mse
  c.feature_projection = ml_collections.ConfigDict()
  c.feature_projection.weight = 0.0  # FeatureProjection weight (0 = off)
  c.feature_projection.layer_map = "auto"  # "s:t,..." hidden-state indices, or auto
  c.feature_projection.loss = "cosine"  # cosine | mse
  return c


def default_teacher_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = ""  # a distillax run whose newest checkpoint is the teacher
  c.hf_path = ""  # or a Hugging Face checkpoint directory (config.json + safetensors)
  c.preset = "demo_teacher"  # or a preset with fresh weights (tests, benchmarks)
  c.param_dtype = ""  # override the teacher's parameter dtype ('' = as stored)
  c.dtype = ""  # override the teacher's compute dtype ('' = as stored)
  c.cache_dir = ""  # an offline teacher cache (distillax cache-teacher): train without a teacher
  return c


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


def strategy_from_config(c, student: TransformerConfig, teacher: TransformerConfig) -> Strategy:
  terms = []
  if c.logit.weight > 0:
    terms.append(LogitKD(temperature=c.logit.temperature, alpha=c.logit.alpha,
                         divergence=c.logit.divergence, beta=c.logit.beta,
                         top_k=c.logit.top_k or None, weight=c.logit.weight))
  ls, lt = student.num_layers, teacher.num_layers
  if c.attention.weight > 0:
    terms.append(AttentionTransfer(
        layer_map=parse_layer_map(c.attention.layer_map, ls, lt, hidden=False),
        loss=c.attention.loss, weight=c.attention.weight))
  if c.feature_pooling.weight > 0:
    terms.append(FeaturePooling(
        layer_map=parse_layer_map(c.feature_pooling.layer_map, ls, lt, hidden=True),
        loss=c.feature_pooling.loss, weight=c.feature_pooling.weight))
  if c.feature_projection.weight > 0:
    terms.append(FeatureProjection(
        layer_map=parse_layer_map(c.feature_projection.layer_map, ls, lt, hidden=True),
        loss=c.feature_projection.loss, weight=c.feature_projection.weight))
  if not terms:
    raise ConfigError("every distill.*.weight is 0; give at least one strategy a weight, e.g. "
                      "--config.distill.logit.weight=1")
  strategy = terms[0]
  for t in terms[1:]:
    strategy = strategy + t
  return strategy


class DistillTrainer(Trainer):
  name = "distill"

  def __init__(self, config, workdir: str):
    super().__init__(config, workdir)
    self._teacher_cfg: TransformerConfig | None = None
    self._cache_info = None

  @property
  def cache_dir(self) -> str:
    """The offline teacher cache this run trains from ('' = an online teacher)."""
    return str(self.config.teacher.get("cache_dir", "") or "")

  def cache_info(self):
    if self._cache_info is None:
      from distillax.distill.cache import read_cache_info
      self._cache_info = read_cache_info(self.cache_dir)
    return self._cache_info

  def teacher_config(self) -> TransformerConfig | None:
    """The teacher's config; None when training from a cache (no teacher runs in the step)."""
    if self.cache_dir:
      return None
    if self._teacher_cfg is None:
      t = self.config.teacher
      if t.workdir:
        from distillax.trainers.loading import trained_model_config
        cfg = trained_model_config(t.workdir)
      elif t.hf_path:
        cfg = _hf_model_config(t.hf_path)
      else:
        from distillax.models.config import get_preset
        cfg = get_preset(t.preset).replace(vocab_size=self.model_config.vocab_size)
      overrides = {k: t[k] for k in ("param_dtype", "dtype") if t[k]}
      cfg = cfg.replace(**overrides) if overrides else cfg
      if cfg.vocab_size != self.model_config.vocab_size:
        raise ConfigError(f"teacher vocabulary {cfg.vocab_size} != student vocabulary "
                          f"{self.model_config.vocab_size}; logit distillation needs one "
                          f"tokenizer: set model.vocab_size={cfg.vocab_size}")
      self._teacher_cfg = cfg
    return self._teacher_cfg

  def strategy(self) -> Strategy:
    if self.cache_dir:
      from distillax.distill import cache_job
      return cache_job.cached_strategy(self.config.distill, self.cache_info(),
                                       self.model_config.vocab_size)
    return strategy_from_config(self.config.distill, self.model_config, self.teacher_config())

  def objective(self):
    chunk = int(self.config.distill.chunk_size) or None
    if self.cache_dir:
      from distillax.distill import cache_job
      return cache_job.cached_objective(self.strategy(), chunk_size=chunk)
    return make_distill_objective(self.strategy(), chunk_size=chunk)

  def _train_iterator(self):
    if not self.cache_dir:
      return super()._train_iterator()
    from distillax.distill import cache_job
    return cache_job.cached_train_iterator(self.cache_dir, global_batch_size=self.batch_size,
                                           seq_len=self.seq_len, seed=int(self.config.seed),
                                           temperature=float(self.config.distill.logit.temperature))

  def _build_engine(self, learning_rate: float, quantize: bool = True):
    if not self.cache_dir:
      return super()._build_engine(learning_rate, quantize)
    from distillax.distill import cache_job
    return cache_job.build_cached_engine(self, learning_rate, quantize)

  def build_models(self, mesh, rules, *, abstract: bool, quantize: bool = True):
    teacher_cfg = self.teacher_config()
    # From a cache there is no teacher and nothing to project to (CachedLogitKD only).
    strategy = self.strategy() if teacher_cfg is not None else None
    seed = int(self.config.seed)

    def wrap(model):
      return DistillStudent(model, strategy,
                            teacher_embed_dim=teacher_cfg.embed_dim if teacher_cfg else None,
                            rngs=nnx.Rngs(seed + 1), param_dtype=self.model_config.param_dtype)

    if abstract:
      student = self.build_student_model(mesh, rules, abstract=True, quantize=quantize)
      extras = {} if teacher_cfg is None else {TEACHER: abstract_model(teacher_cfg, seed)}
      return nnx.eval_shape(lambda: wrap(student)), extras
    student = self.build_student_model(mesh, rules, abstract=False, quantize=quantize)
    student = place_module(wrap(student), mesh, rules)
    if teacher_cfg is None:
      return student, {}
    return student, {TEACHER: self._load_teacher(teacher_cfg, mesh, rules)}

  def load_teacher(self, mesh, rules):
    """The frozen teacher alone, sharded on `mesh` (the cache-teacher and sequence-KD jobs)."""
    cfg = self.teacher_config()
    if cfg is None:
      raise ConfigError("teacher.cache_dir is set, but this job runs the teacher itself; clear "
                        "--config.teacher.cache_dir and name teacher.workdir, hf_path or preset")
    return self._load_teacher(cfg, mesh, rules)

  def _load_teacher(self, cfg: TransformerConfig, mesh, rules):
    t = self.config.teacher
    if t.workdir:
      from distillax.trainers.loading import load_trained_model
      model = load_trained_model(t.workdir, mesh, rules)
    elif t.hf_path:
      from distillax.models import hf
      model = hf.load(t.hf_path, mesh=mesh, rules=rules)
    else:
      return create_model(cfg, mesh=mesh, rules=rules, seed=int(self.config.seed) + 1000)
    if model.config != cfg:
      model = _recast(model, cfg, mesh, rules)
    return model


def _hf_model_config(path: str) -> TransformerConfig:
  import json
  import os
  from distillax.errors import UserError
  from distillax.models.hf_config import config_from_hf
  file = os.path.join(path, "config.json")
  if not os.path.exists(file):
    raise UserError(f"teacher.hf_path={path} has no config.json; point it at a Hugging Face "
                    f"checkpoint directory")
  with open(file) as f:
    return config_from_hf(json.load(f), where=file)


def _recast(model, cfg: TransformerConfig, mesh, rules):
  """The same weights under another dtype setting (e.g. a bf16 copy of an fp32 teacher)."""
  import jax
  from distillax import partitioning as pt
  from distillax.models.transformer import Transformer
  target = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graph, abstract = nnx.split(target)
  values = jax.tree.map(lambda v, a: v.astype(a.dtype), nnx.to_pure_dict(nnx.state(model)),
                        nnx.to_pure_dict(abstract))
  shardings = pt.tree_shardings(values, pt.logical_tree(abstract), mesh, rules)
  return nnx.merge(graph, jax.device_put(values, shardings))


__all__ = ["DistillTrainer", "default_distill_config", "default_teacher_config",
           "resolve_model_config", "strategy_from_config", "parse_layer_map"]
