"""The trainable side of distillation: the student model plus what only training needs.

`DistillStudent` holds the Transformer (`model`) and the learned feature projections of every
`FeatureProjection` in the strategy (`projections[strategy name][pair index]`). The trainer
optimises and checkpoints the wrapper as one module, so projections train and resume with the
student; export takes `.model` alone, so they never reach the exported weights.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from distillax.distill.base import Strategy
from distillax.distill.features import FeatureProjection
from distillax.errors import ConfigError


class DistillStudent(nnx.Module):
  """Student Transformer + training-only projections (one module, one trainable tree)."""

  def __init__(self, model: nnx.Module, strategy: Strategy | None = None, *,
               teacher_embed_dim: int | None = None, rngs: nnx.Rngs | None = None,
               param_dtype: str = "float32"):
    self.model = model
    projections = {}
    for _, leaf in (strategy.leaves() if strategy is not None else ()):
      if not isinstance(leaf, FeatureProjection):
        continue
      if teacher_embed_dim is None or rngs is None:
        raise ConfigError(f"FeatureProjection {leaf.name!r} needs DistillStudent(..., "
                          f"teacher_embed_dim=<teacher width>, rngs=nnx.Rngs(seed)) to create "
                          f"its projections")
      projections[leaf.name] = leaf.make_projections(model.config.embed_dim, teacher_embed_dim,
                                                     rngs, param_dtype)
    self.projections = nnx.Dict(projections)

  @property
  def config(self):
    return self.model.config

  def __call__(self, tokens_BxL: jax.Array, **kwargs):
    return self.model(tokens_BxL, **kwargs)

  def logits_from_hidden(self, h_xD: jax.Array) -> jax.Array:
    return self.model.logits_from_hidden(h_xD)


def unwrap_student(student: nnx.Module) -> tuple[nnx.Module, Any]:
  """(the Transformer, its projections or None) from a DistillStudent or a bare model."""
  if isinstance(student, DistillStudent):
    return student.model, student.projections
  return student, None
