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
from distillax.models.hf_config import config_from_hf
from distillax.trainers.common import resolve_model_config
from distillax.trainers.registry import recipe_for
from distillax.trainers.workdir import CHECKPOINT_DIR, CONFIG_FILE


# Keys of a Hugging Face config.json that a distillax run's config.json never has.
_HF_KEYS = ("model_type", "architectures", "transformers_version")


def load_run_config(workdir: str, field: str = "") -> ml_collections.ConfigDict:
  """The config.json of the distillax run in `workdir`; `field` (e.g. 'train.init_from') names
  the setting that pointed here, so a wrong directory is one line naming it and the fix."""
  where = workdir if not field else (
      f"{field} {workdir}" if field.startswith("--") else f"{field}={workdir}")
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise UserError(f"{where} is not a distillax run directory (no {CONFIG_FILE}); point to "
                    f"the --workdir of a finished run")
  try:
    with open(path) as f:
      raw = json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(f"{where}: {CONFIG_FILE} is unreadable ({e}); point to the --workdir of a "
                    f"finished distillax run") from None
  if isinstance(raw, dict) and "trainer" in raw and "model" in raw:
    return ml_collections.ConfigDict(raw)
  if isinstance(raw, dict) and any(k in raw for k in _HF_KEYS):
    raise UserError(f"{where} is a Hugging Face checkpoint, not a distillax run; "
                    f"{field or 'it'} must be a distillax run's directory (the --workdir it "
                    f"trained in); a Hugging Face teacher goes in --config.teacher.hf_path, a "
                    f"Hugging Face student in --config.student.hf_path or train.init_from")
  raise UserError(f"{where}: {CONFIG_FILE} was not written by distillax (no trainer and model "
                  f"sections); point to the --workdir of a finished distillax run")


def is_hf_checkpoint(path: str) -> bool:
  """Whether `path` is a Hugging Face checkpoint directory (its config.json has HF keys)."""
  try:
    with open(os.path.join(path, CONFIG_FILE)) as f:
      raw = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(raw, dict) and any(k in raw for k in _HF_KEYS)


def hf_checkpoint_config(path: str, field: str) -> TransformerConfig:
  """The model config of the Hugging Face checkpoint `field` names, or one line saying what
  the directory is instead."""
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(file):
    raise UserError(f"{field}={path} has no config.json; point it at a Hugging Face checkpoint "
                    f"directory (config.json + *.safetensors)")
  if not is_hf_checkpoint(path):
    raise UserError(f"{field}={path} is not a Hugging Face checkpoint (its config.json has no "
                    f"model_type); a distillax run's directory goes in train.init_from or "
                    f"teacher.workdir")
  with open(file) as f:
    return config_from_hf(json.load(f), where=file)


def trained_model_config(workdir: str, field: str = "") -> TransformerConfig:
  cfg = load_run_config(workdir, field)
  return resolve_model_config(cfg.model, make_tokenizer(cfg.data.tokenizer))


def as_loaded(cfg: ml_collections.ConfigDict, *, keep_data: bool = False
              ) -> ml_collections.ConfigDict:
  """An earlier run's config as its loading needs it: its weights come from its own checkpoint,
  so neither its starting point (train.init_from, the student section) nor, unless
  `keep_data` (evaluating it), its data files (which may have moved since) are read, and the
  recipe's up-front checks must not ask for them."""
  cfg = cfg.copy_and_resolve_references()
  cfg.train.init_from = ""
  if "student" in cfg:  # the model section already has the shape its source gave
    cfg.student.hf_path, cfg.student.from_teacher.layers = "", ()
  if not keep_data:
    cfg.data.source, cfg.data.eval_source = "stdlib", ""
  return cfg


def restore_newest(workdir: str, layout):
  """The TrainState of `workdir`'s newest valid checkpoint, restored onto `layout` (this
  run's mesh and shardings, whatever topology saved it)."""
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(ckpt_dir):
    raise UserError(f"{workdir} has no {CHECKPOINT_DIR}/; train it first")
  with Checkpointer(ckpt_dir, every_steps=0, keep_last=None) as ckpt:
    restored = ckpt.restore_latest_valid(abstract_state=layout.abstract,
                                         shardings=layout.shardings)
  if restored is None:
    raise UserError(f"no valid checkpoint in {ckpt_dir}; train the run to a checkpoint first")
  return restored[0]


def load_trained_model(workdir: str, mesh: Mesh, rules: pt.RuleSet) -> nnx.Module:
  """The plain student Transformer of `workdir`'s newest valid checkpoint, sharded for
  `mesh`/`rules` (LoRA merged, fake quantization and training-only parts off)."""
  workdir = os.path.abspath(workdir)
  recipe = recipe_for(as_loaded(load_run_config(workdir)), workdir=workdir, mesh=mesh,
                      rules=rules)
  student, extras = recipe.build(abstract=True)
  trainable = recipe.trainable()
  _, train_state, _ = nnx.split(student, trainable, ...)
  tx, _ = optim.make_optimizer(recipe.config.optimizer, int(recipe.config.train.steps),
                               nnx.to_pure_dict(train_state))
  layout = build_layout(student, extras, tx, mesh, rules, trainable)
  state = restore_newest(workdir, layout)
  merged, _ = layout.defs.merge(state.params, state.frozen)
  return recipe.export_model(merged)
