"""An earlier run as a model source: its trained student, read alone from its newest valid
checkpoint onto this job's mesh, whatever topology saved it.

Only the student's arrays are read (an orbax partial restore): no optimizer state, no teacher,
no rebuilt recipe. What the run trained is in the checkpoint; a LoRA run's frozen base is not
(checkpoints leave reloadable models out), so it comes from the run's own student source, and
the run's transforms merge the adapters into it.
"""

from __future__ import annotations

import os

import jax
import ml_collections
from flax import nnx

from distillax import partitioning as pt
from distillax.errors import UserError
from distillax.framework.run.checkpoint import Checkpointer
from distillax.models.init import abstract_model
from distillax.trainers.registry import recipe_class
from distillax.trainers.sources import files
from distillax.trainers.transforms import StudentTransforms


def as_loaded(cfg: ml_collections.ConfigDict, *, keep_data: bool = False
              ) -> ml_collections.ConfigDict:
  """An earlier run's config as its loading needs it: its weights come from its own checkpoint,
  so neither its starting point (train.init_from, the student section) nor, unless
  `keep_data` (evaluating it), its data files and eval.generate's file (which may have moved
  since) are read, and the recipe's up-front checks must not ask for them."""
  cfg = cfg.copy_and_resolve_references()
  cfg.train.init_from = ""
  if "student" in cfg:  # the model section already has the shape its source gave (the
    # blocks and the experts it kept of them)
    cfg.student.hf_path, cfg.student.from_teacher.layers = "", ()
    if "experts" in cfg.student.from_teacher:
      cfg.student.from_teacher.experts = ()
  if not keep_data:
    cfg.data.source, cfg.data.eval_source = "stdlib", ""
    if "eval" in cfg:  # nor its held-out generation file, nor a guard that watches its scores
      cfg.eval.generate, cfg.train.rollback_metric = "", None
  return cfg


def checkpoints_of(workdir: str, field: str = "") -> Checkpointer:
  ckpt_dir = os.path.join(workdir, files.CHECKPOINT_DIR)
  if not os.path.isdir(ckpt_dir):
    raise UserError(f"{files.where(workdir, field)} has no {files.CHECKPOINT_DIR}/ yet; train "
                    f"that run first")
  return Checkpointer(ckpt_dir, every_steps=0, keep_last=None)


def checkpoint_fingerprint(workdir: str) -> dict:
  """The newest checkpoint step of a run and its state item's index files: continuing the run
  or replacing its checkpoints changes it."""
  with checkpoints_of(workdir) as ckpt:
    step = ckpt.latest_step()
    state_dir = str(ckpt.step_dir(step) / "state") if step is not None else ""
  names = [n for n in os.listdir(state_dir) if os.path.isfile(os.path.join(state_dir, n))] \
      if state_dir else []
  return {"step": step, "files": files.files_fingerprint(state_dir, names) if names else []}


def load_run_student(source, mesh, rules) -> tuple[nnx.Module, int]:
  """(the plain student Transformer of `source` (a RunSource) at its newest valid checkpoint,
  sharded for `mesh`/`rules`: LoRA merged, fake quantization off, no training-only parts; the
  step it was read from: an older one when the newest cannot be read)."""
  run = source.run_config
  cfg, seed = source.model_config(), int(run.seed)
  transforms = StudentTransforms.from_config(run)
  trained = nnx.eval_shape(lambda: transforms.apply(abstract_model(cfg, seed), quantize=False))
  graph, train_state, rest_state = nnx.split(trained, transforms.trainable(), ...)
  want = nnx.to_pure_dict(train_state)
  shardings = pt.tree_shardings(want, pt.logical_tree(train_state), mesh, rules)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), want,
                        shardings)
  path = recipe_class(run).student_path  # where the plain student sits in the trained tree
  for key in reversed(path):
    target = {key: target}
  with checkpoints_of(source.workdir, source.field) as ckpt:
    step, restored = ckpt.restore_arrays({"params": target})
  values = restored["params"]
  for key in path:
    values = values[key]
  if nnx.to_pure_dict(rest_state):  # a frozen base the checkpoint does not hold: LoRA
    base = source.base_of(run).load(cfg, mesh, rules, seed=seed)
    model = transforms.apply(base, quantize=False)
    nnx.update(model, _state_of(model, transforms.trainable(), values))
  else:
    nnx.replace_by_pure_dict(train_state, values)
    model = nnx.merge(graph, train_state, rest_state)
  return transforms.strip(model), step


def _state_of(model, trainable, values):
  """The trainable state of `model` holding `values` (a pure dict)."""
  state = nnx.state(model, trainable)
  nnx.replace_by_pure_dict(state, values)
  return state
