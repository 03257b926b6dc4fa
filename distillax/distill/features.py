"""Feature distillation: the student's residual stream imitates the teacher's, layer by layer.

Layers index `ModelOutput.hidden_states` (num_layers + 1, B, L, D): 0 is the embedding output,
i the output of block i. Per real token the term is

  sum over mapped layers of  d(student feature, teacher feature)

with d = 1 - cosine similarity ('cosine') or the squared error averaged over the feature dims
('mse'). The two widths are reconciled in one of two ways:

  FeaturePooling: the teacher is average-pooled to the student width (mean over consecutive
    groups of D_teacher / D_student dims). Nothing is learned.
  FeatureProjection: the student is mapped to the teacher width by a learned matrix per mapped
    layer (`Projection`), which lives in the student wrapper (`DistillStudent.projections`), so
    it trains and checkpoints with the student and is left out of the exported model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.distill.base import (DistillInputs, Needs, Strategy, check_common,
                                    check_layer_range, masked_sum, normalize_layer_map)
from distillax.errors import ConfigError

FEATURE_LOSSES = ("cosine", "mse")
_NORM_FLOOR = 1e-12  # squared norms are floored here so a zero vector has a finite gradient


def feature_distance(kind: str, student_BxLxD: jax.Array, teacher_BxLxD: jax.Array) -> jax.Array:
  """Per-token distance (B, L) between features of equal width, in fp32."""
  s, t = student_BxLxD.astype(jnp.float32), teacher_BxLxD.astype(jnp.float32)
  if kind == "cosine":
    s_norm = jnp.sqrt(jnp.maximum(jnp.sum(s * s, axis=-1), _NORM_FLOOR))
    t_norm = jnp.sqrt(jnp.maximum(jnp.sum(t * t, axis=-1), _NORM_FLOOR))
    return 1.0 - jnp.sum(s * t, axis=-1) / (s_norm * t_norm)
  return jnp.mean(jnp.square(s - t), axis=-1)


def pool_features(x_BxLxD: jax.Array, width: int) -> jax.Array:
  """Average pooling of the last dim over consecutive groups down to `width`."""
  *lead, D = x_BxLxD.shape
  return jnp.mean(x_BxLxD.reshape(*lead, width, D // width), axis=-1)


def _hidden_pair(inputs: DistillInputs, owner: str, layer_map):
  s_h, t_h = inputs.student.hidden_states, inputs.teacher.hidden_states
  if s_h is None or t_h is None:
    raise ConfigError(f"{owner} needs hidden states from both models; run them with "
                      f"return_hidden_states=True (make_distill_objective does)")
  check_layer_range(layer_map, s_h.shape[0], t_h.shape[0], owner, "hidden state",
                    "0 = embeddings, i = output of block i")
  return s_h, jax.lax.stop_gradient(t_h)


def _check_loss(owner: str, loss: str) -> None:
  if loss not in FEATURE_LOSSES:
    raise ConfigError(f"{owner}.loss={loss!r}; choose one of {', '.join(FEATURE_LOSSES)}")


@dataclasses.dataclass(frozen=True)
class FeaturePooling(Strategy):
  """Hidden-state imitation with the teacher average-pooled to the student width.
  layer_map: {student hidden-state index: teacher hidden-state index}; loss: 'cosine' | 'mse'."""

  layer_map: Any = None
  loss: str = "cosine"
  weight: float = 1.0
  name: str = "feature_pooling"

  def __post_init__(self):
    check_common(self)
    object.__setattr__(self, "layer_map",
                       normalize_layer_map(self.layer_map or {}, "FeaturePooling"))
    _check_loss("FeaturePooling", self.loss)

  @property
  def needs(self) -> Needs:
    return Needs(hidden_states=True, teacher=True)

  def term_sums(self, inputs: DistillInputs):
    s_h, t_h = _hidden_pair(inputs, "FeaturePooling", self.layer_map)
    ds, dt = s_h.shape[-1], t_h.shape[-1]
    if dt % ds:
      raise ConfigError(f"FeaturePooling: the teacher width ({dt}) is not a multiple of the "
                        f"student width ({ds}), so it cannot be average-pooled onto it; use "
                        f"FeatureProjection (a learned map) instead")
    per_token_BxL = 0.0
    for s_layer, t_layer in self.layer_map:
      teacher = pool_features(t_h[t_layer].astype(jnp.float32), ds)
      per_token_BxL = per_token_BxL + feature_distance(self.loss, s_h[s_layer], teacher)
    term = masked_sum(per_token_BxL, inputs.mask_BxL)
    return term, {self.name: term}


class Projection(nnx.Module):
  """A learned linear map from the student width to the teacher width (no bias)."""

  def __init__(self, student_dim: int, teacher_dim: int, *, rngs: nnx.Rngs,
               param_dtype: str = "float32"):
    value = jax.random.normal(rngs.params(), (student_dim, teacher_dim), jnp.float32)
    self.kernel = nnx.Param((value * student_dim ** -0.5).astype(param_dtype),
                            logical_axes=("embed", None))

  def __call__(self, x_xD: jax.Array) -> jax.Array:
    return jnp.einsum("...d,dt->...t", x_xD.astype(jnp.float32),
                      self.kernel[...].astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class FeatureProjection(Strategy):
  """Hidden-state imitation through a learned student -> teacher width projection per mapped
  layer. The projections live in `DistillStudent.projections[name]` (one per layer_map pair, in
  sorted student-layer order): build the student with `DistillStudent(model, strategy, ...)`."""

  layer_map: Any = None
  loss: str = "cosine"
  weight: float = 1.0
  name: str = "feature_projection"

  def __post_init__(self):
    check_common(self)
    object.__setattr__(self, "layer_map",
                       normalize_layer_map(self.layer_map or {}, "FeatureProjection"))
    _check_loss("FeatureProjection", self.loss)

  @property
  def needs(self) -> Needs:
    return Needs(hidden_states=True, teacher=True)

  def make_projections(self, student_dim: int, teacher_dim: int, rngs: nnx.Rngs,
                       param_dtype: str = "float32") -> nnx.List:
    return nnx.List([Projection(student_dim, teacher_dim, rngs=rngs, param_dtype=param_dtype)
                     for _ in self.layer_map])

  def term_sums(self, inputs: DistillInputs):
    s_h, t_h = _hidden_pair(inputs, "FeatureProjection", self.layer_map)
    projections = inputs.projections
    if projections is None or self.name not in projections:
      raise ConfigError(f"FeatureProjection {self.name!r}: the student has no projection for it; "
                        f"wrap the student as DistillStudent(model, strategy, "
                        f"teacher_embed_dim=..., rngs=...) so the projections train with it")
    layers = projections[self.name]
    if len(layers) != len(self.layer_map):
      raise ConfigError(f"FeatureProjection {self.name!r}: the student holds {len(layers)} "
                        f"projections for a layer map of {len(self.layer_map)} pairs; rebuild the "
                        f"DistillStudent with this strategy")
    per_token_BxL = 0.0
    for projection, (s_layer, t_layer) in zip(layers, self.layer_map):
      kernel_shape = projection.kernel.shape
      if kernel_shape != (s_h.shape[-1], t_h.shape[-1]):
        raise ConfigError(f"FeatureProjection {self.name!r}: projection {kernel_shape} does not "
                          f"map the student width {s_h.shape[-1]} to the teacher width "
                          f"{t_h.shape[-1]}; rebuild the DistillStudent with "
                          f"teacher_embed_dim={t_h.shape[-1]}")
      per_token_BxL = per_token_BxL + feature_distance(self.loss, projection(s_h[s_layer]),
                                                       t_h[t_layer])
    term = masked_sum(per_token_BxL, inputs.mask_BxL)
    return term, {self.name: term}
