"""The student a recipe starts from: fresh weights, or an earlier run's (`train.init_from`)."""

from __future__ import annotations

from flax import nnx

from distillax.errors import ConfigError
from distillax.models.config import TransformerConfig
from distillax.models.init import abstract_model, create_model
from distillax.trainers.runs import load_trained_model


def base_student(cfg: TransformerConfig, config, mesh, rules, *, abstract: bool) -> nnx.Module:
  """The plain Transformer before any transform. Abstract modules hold shapes only; real ones
  are created sharded (no host ever holds the whole model)."""
  seed = int(config.seed)
  if abstract:
    return abstract_model(cfg, seed)
  init_from = config.train.get("init_from", "")
  if not init_from:
    return create_model(cfg, mesh=mesh, rules=rules, seed=seed)
  model = load_trained_model(init_from, mesh, rules)
  if model.config != cfg:
    raise ConfigError(f"train.init_from={init_from} holds a model of another shape "
                      f"({model.config}); make the model section match it")
  return model
