"""The student a recipe starts from: fresh weights, or an earlier run's (`train.init_from`)."""

from __future__ import annotations

import dataclasses
import os

from flax import nnx

from distillax.errors import ConfigError
from distillax.models.config import TransformerConfig
from distillax.models.init import abstract_model, create_model
from distillax.trainers.runs import load_trained_model, trained_model_config
from distillax.trainers.workdir import CHECKPOINT_DIR


def check_init_from(config, cfg: TransformerConfig) -> None:
  """Refuses a `train.init_from` the student cannot start from, before anything is built or a
  workdir is touched: not a distillax run (a Hugging Face directory, say), no checkpoints yet,
  or a model of another shape than `cfg` (this config's)."""
  init_from = str(config.train.get("init_from", "") or "")
  if not init_from:
    return
  earlier = trained_model_config(init_from, field="train.init_from")
  if not os.path.isdir(os.path.join(init_from, CHECKPOINT_DIR)):
    raise ConfigError(f"train.init_from={init_from} has no {CHECKPOINT_DIR}/ yet; train that "
                      f"run first or leave train.init_from empty")
  if earlier != cfg:
    diff = [f.name for f in dataclasses.fields(cfg)
            if getattr(earlier, f.name) != getattr(cfg, f.name)]
    fix = " ".join(f"--config.model.{k}={getattr(earlier, k)!r}" for k in diff[:4])
    raise ConfigError(f"train.init_from={init_from} holds a model with "
                      + ", ".join(f"{k}={getattr(earlier, k)!r}" for k in diff)
                      + " but this config's model has "
                      + ", ".join(f"{k}={getattr(cfg, k)!r}" for k in diff)
                      + f"; make the model section match it, e.g. {fix}")


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
