"""Models from earlier runs: a teacher from a distillax workdir, a student to continue training.

A workdir's config.json names the recipe and model that produced it; rebuilding that recipe's
state layout (abstractly: no compile, no parameters) lets orbax restore the newest valid
checkpoint straight onto *this* run's mesh and rules, whatever topology the other run used.
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
from distillax.trainers.common import resolve_model_config
from distillax.trainers.registry import recipe_for
from distillax.trainers.workdir import CHECKPOINT_DIR, CONFIG_FILE


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise UserError(f"{workdir} is not a distillax run directory (no {CONFIG_FILE}); point to "
                    f"the --workdir of a finished run")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def trained_model_config(workdir: str) -> TransformerConfig:
  cfg = load_run_config(workdir)
  return resolve_model_config(cfg.model, make_tokenizer(cfg.data.tokenizer))


def load_trained_model(workdir: str, mesh: Mesh, rules: pt.RuleSet) -> nnx.Module:
  """The plain student Transformer of `workdir`'s newest valid checkpoint, sharded for
  `mesh`/`rules` (LoRA merged, fake quantization and training-only parts off)."""
  workdir = os.path.abspath(workdir)
  recipe = recipe_for(load_run_config(workdir), workdir=workdir, mesh=mesh, rules=rules)
  student, extras = recipe.build(abstract=True)
  trainable = recipe.trainable()
  _, train_state, _ = nnx.split(student, trainable, ...)
  tx, _ = optim.make_optimizer(recipe.config.optimizer, int(recipe.config.train.steps),
                               nnx.to_pure_dict(train_state))
  layout = build_layout(student, extras, tx, mesh, rules, trainable)
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(ckpt_dir):
    raise UserError(f"{workdir} has no {CHECKPOINT_DIR}/; train it first")
  with Checkpointer(ckpt_dir, every_steps=0, keep_last=None) as ckpt:
    restored = ckpt.restore_latest_valid(abstract_state=layout.abstract,
                                         shardings=layout.shardings)
  if restored is None:
    raise UserError(f"no valid checkpoint in {ckpt_dir}; train the run to a checkpoint first")
  state = restored[0]
  merged, _ = layout.defs.merge(state.params, state.frozen)
  return recipe.export_model(merged)
