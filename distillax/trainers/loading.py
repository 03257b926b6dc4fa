"""Models from earlier runs: a teacher from a distillax workdir, a student to continue training.

A workdir's config.json says which trainer and model produced it; rebuilding that trainer's state
layout (abstractly: no compile, no parameters) lets orbax restore the newest valid checkpoint
straight onto *this* run's mesh and rules, whatever topology the other run used.
"""

from __future__ import annotations

import json
import os

import ml_collections
from flax import nnx
from jax.sharding import Mesh

from distillax import partitioning as pt
from distillax.data import make_tokenizer
from distillax.errors import UserError
from distillax.framework import optim
from distillax.framework.checkpoint import Checkpointer
from distillax.framework.state import build_layout
from distillax.models.config import TransformerConfig
from distillax.trainers.base import resolve_model_config


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise UserError(f"{workdir} is not a distillax run directory (no config.json); point to the "
                    f"--workdir of a finished run")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def run_trainer(workdir: str, mesh: Mesh, rules: pt.RuleSet):
  """The trainer that produced `workdir`, set up abstractly on this mesh and rules."""
  from distillax.trainers import get_trainer
  cfg = load_run_config(workdir)
  trainer = get_trainer(cfg.trainer)(cfg, workdir)
  trainer.mesh, trainer.rules = mesh, rules
  trainer.tokenizer = make_tokenizer(cfg.data.tokenizer)
  trainer.model_config = resolve_model_config(cfg.model, trainer.tokenizer)
  return trainer


def trained_model_config(workdir: str) -> TransformerConfig:
  cfg = load_run_config(workdir)
  return resolve_model_config(cfg.model, make_tokenizer(cfg.data.tokenizer))


def load_trained_model(workdir: str, mesh: Mesh, rules: pt.RuleSet) -> nnx.Module:
  """The student Transformer of `workdir`'s newest valid checkpoint, sharded for `mesh`/`rules`."""
  trainer = run_trainer(workdir, mesh, rules)
  student, extras = trainer.build_models(mesh, rules, abstract=True)
  trainable = trainer.trainable()
  _, train_state, _ = nnx.split(student, trainable, ...)
  tx, _ = optim.make_optimizer(trainer.config.optimizer, int(trainer.config.train.steps),
                               nnx.to_pure_dict(train_state))
  layout = build_layout(student, extras, tx, mesh, rules, trainable)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(ckpt_dir):
    raise UserError(f"{workdir} has no checkpoints/; train it first")
  with Checkpointer(ckpt_dir, every_steps=0, keep_last=None) as ckpt:
    restored = ckpt.restore_latest_valid(abstract_state=layout.abstract,
                                         shardings=layout.shardings)
  if restored is None:
    raise UserError(f"no valid checkpoint in {ckpt_dir}; train the run to a checkpoint first")
  state = restored[0]
  merged, _ = layout.defs.merge(state.params, state.frozen)
  return trainer.export_model(merged)
