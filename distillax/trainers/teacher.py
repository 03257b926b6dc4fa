"""The teacher, from whichever source the `teacher` section names, through one function.

Sources, first set wins: an earlier distillax run (`workdir`), a Hugging Face checkpoint
directory (`hf_path`), a preset with fresh weights (`preset`: tests, benchmarks). An offline
cache (`cache_dir`) is a source of teacher *outputs*, not of a model: `teacher_config` says so
with None, and asking it for a model is an error naming the fix.
"""

from __future__ import annotations

import os

import jax
import ml_collections
from flax import nnx

from distillax import partitioning as pt
from distillax.errors import ConfigError
from distillax.models import hf
from distillax.models.config import TransformerConfig, get_preset
from distillax.models.init import create_model
from distillax.models.transformer import Transformer
from distillax.trainers.runs import (hf_checkpoint_config, load_run_config, load_trained_model,
                                     trained_model_config)

# Fresh preset teachers draw from their own seed stream, apart from the student's.
PRESET_SEED_OFFSET = 1000


def teacher_source_config(teacher, vocab_size: int) -> TransformerConfig:
  """The teacher model's config as its source stores it (no dtype override, no vocabulary
  check); a preset gets `vocab_size`. A student derived from the teacher starts from this."""
  if teacher.workdir:
    return trained_model_config(teacher.workdir, field="teacher.workdir")
  if teacher.hf_path:
    return hf_checkpoint_config(teacher.hf_path, "teacher.hf_path")
  return get_preset(teacher.preset).replace(vocab_size=vocab_size)


def teacher_tokenizer_file(teacher) -> str | None:
  """The tokenizer.json the teacher was trained with, when its source has one: a Hugging Face
  checkpoint's own, or an earlier run's `hf:` data tokenizer. None for byte/spm and presets."""
  if teacher.workdir:
    return hf_tokenizer_file(str(load_run_config(teacher.workdir, "teacher.workdir")
                                 .data.tokenizer))
  if teacher.hf_path:
    file = os.path.join(teacher.hf_path, "tokenizer.json")
    return file if os.path.isfile(file) else None
  return None


def hf_tokenizer_file(spec: str) -> str | None:
  """The tokenizer.json of an 'hf:<file or folder>' tokenizer spec; None for other specs."""
  kind, _, path = str(spec).strip().partition(":")
  if kind != "hf" or not path:
    return None
  path = os.path.expanduser(path)
  return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


def as_stored(teacher):
  """The teacher section without its dtype overrides and cache: the source's own model (what
  a student derived from the teacher copies, bit for bit)."""
  out = ml_collections.ConfigDict(teacher.to_dict())
  out.param_dtype = out.dtype = ""
  if "cache_dir" in out:
    out.cache_dir = ""
  return out


def teacher_config(teacher, vocab_size: int) -> TransformerConfig | None:
  """The teacher model's config, checked against the student's vocabulary; None when the job
  trains from an offline cache (no teacher runs in the step)."""
  if teacher.get("cache_dir"):
    return None
  cfg = teacher_source_config(teacher, vocab_size)
  overrides = {k: teacher[k] for k in ("param_dtype", "dtype") if teacher[k]}
  cfg = cfg.replace(**overrides) if overrides else cfg
  if cfg.vocab_size != vocab_size:
    raise ConfigError(f"teacher vocabulary {cfg.vocab_size} != student vocabulary {vocab_size}; "
                      f"logit distillation needs one tokenizer: set "
                      f"model.vocab_size={cfg.vocab_size}")
  return cfg


def load_teacher(teacher, vocab_size: int, mesh, rules, *, seed: int) -> nnx.Module:
  """The frozen teacher, sharded on `mesh` by `rules` (read tensor by tensor from its source)."""
  cfg = teacher_config(teacher, vocab_size)
  if cfg is None:
    raise ConfigError("teacher.cache_dir is set, but this job runs the teacher itself; clear "
                      "--config.teacher.cache_dir and name teacher.workdir, hf_path or preset")
  if teacher.workdir:
    model = load_trained_model(teacher.workdir, mesh, rules)
  elif teacher.hf_path:
    model = hf.load(teacher.hf_path, mesh=mesh, rules=rules)
  else:
    return create_model(cfg, mesh=mesh, rules=rules, seed=seed + PRESET_SEED_OFFSET)
  if model.config != cfg:
    model = _recast(model, cfg, mesh, rules)
  return model


def _recast(model, cfg: TransformerConfig, mesh, rules):
  """The same weights under another dtype setting (e.g. a bf16 copy of an fp32 teacher)."""
  target = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graph, abstract = nnx.split(target)
  values = jax.tree.map(lambda v, a: v.astype(a.dtype), nnx.to_pure_dict(nnx.state(model)),
                        nnx.to_pure_dict(abstract))
  shardings = pt.tree_shardings(values, pt.logical_tree(abstract), mesh, rules)
  return nnx.merge(graph, jax.device_put(values, shardings))
