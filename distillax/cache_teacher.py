"""`distillax cache-teacher`: run the teacher once, store its outputs, train without it later.

  distillax cache-teacher --config distillax/configs/distill_cached.py --workdir runs/cache \
      --config.teacher.workdir=runs/teacher
  distillax train --config distillax/configs/distill_cached.py --workdir runs/kd_cached \
      --config.teacher.cache_dir=runs/cache

The job asks the distillation recipe for the teacher (the `teacher` section, through the one
`load_teacher`), runs it over `cache.num_batches` batches of the train pipeline and writes, with
`write_teacher_cache`, their top-k (`cache.top_k`) at the distillation temperature, or with
`--kind hidden` (cache.kind) the teacher's final hidden states in `cache.dtype` and its LM head
beside them, from which training rebuilds the exact logits for any strategy and temperature.
Under several processes each writes the rows of its own data shard. Training from the cache is
the cached-distillation recipe (trainers/distill/cached.py).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from distillax.data import batch as batch_spec
from distillax.distill.teacher_cache import CACHE_INFO, HIDDEN_DTYPES, KINDS, write_teacher_cache
from distillax.errors import ConfigError, UserError
from distillax import jsonio
from distillax.framework.backends import batch_sharding, global_batch_placer
from distillax.framework.run.progress import ProgressBar
from distillax.trainers import DistillRecipe, check_recipe_data, recipe_for

PROVENANCE_FILE = "cache_job.json"


def _check(config, directory: str | None) -> str:
  """The cache directory, after every check that needs no model."""
  if "teacher" not in config or "cache" not in config or "distill" not in config:
    raise ConfigError("cache-teacher needs a distillation config (teacher, distill and cache "
                      "sections); use distillax/configs/distill_cached.py")
  cc = config.cache
  directory = cc.dir or directory
  if not directory:
    raise UserError("--workdir is required for cache-teacher (or set --config.cache.dir): the "
                    "directory the teacher cache is written to")
  directory = os.path.abspath(directory)
  if cc.kind not in KINDS:
    raise ConfigError(f"cache.kind={cc.kind!r}; choose one of {', '.join(KINDS)} (--kind)")
  if cc.kind == "hidden" and cc.dtype not in HIDDEN_DTYPES:
    raise ConfigError(f"cache.dtype={cc.dtype!r}; choose one of {', '.join(HIDDEN_DTYPES)} "
                      f"(float32 for exact teacher logits)")
  if os.path.exists(os.path.join(directory, CACHE_INFO)):
    raise UserError(f"{directory} already holds a teacher cache ({CACHE_INFO}); pick a new "
                    f"--workdir or delete the old cache")
  if config.teacher.cache_dir:
    raise ConfigError("teacher.cache_dir is set, but cache-teacher writes a cache; clear "
                      "--config.teacher.cache_dir and name the teacher (teacher.workdir, "
                      "teacher.hf_path or teacher.preset)")
  if int(cc.num_batches) < 1:
    raise ConfigError(f"cache.num_batches={cc.num_batches} must be >= 1")
  return directory


def _host_rows(mesh, rules):
  """A teacher output (a global array) -> this process's rows of it, as numpy."""
  def fetch(x):
    rows = jax.jit(lambda x: x, out_shardings=batch_sharding(mesh, rules, 1, x.shape[:1]))(x)
    shards = {s.index[0].start or 0: s.data for s in rows.addressable_shards}
    return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])
  return fetch


def run_cache_teacher(config, workdir: str | None, *, kind: str | None = None,
                      model_overrides=None) -> int:
  """Writes the teacher cache to cache.dir or the workdir; returns 0. `kind` (the --kind flag)
  overrides cache.kind."""
  if kind is not None and "cache" in config:
    config = config.copy_and_resolve_references()
    config.cache.kind = kind
  directory = _check(config, workdir)
  cc = config.cache
  recipe = recipe_for(config, model_overrides=model_overrides)
  if not isinstance(recipe, DistillRecipe):
    raise ConfigError(f"cache-teacher needs trainer='distill', not {config.trainer!r}")
  teacher_cfg = recipe.teacher_model_config
  top_k, temperature = int(cc.top_k), float(config.distill.logit.temperature)
  if cc.kind == "topk" and not 0 < top_k <= teacher_cfg.vocab_size:
    raise ConfigError(f"cache.top_k={cc.top_k} must be in 1..{teacher_cfg.vocab_size} (the "
                      f"teacher vocabulary)")
  if recipe.seq_len > teacher_cfg.max_seq_len:
    raise ConfigError(f"train.seq_len={recipe.seq_len} exceeds the teacher's max_seq_len="
                      f"{teacher_cfg.max_seq_len}; lower train.seq_len")
  check_recipe_data(recipe)
  batches = recipe.train_iterator()
  teacher = recipe.load_teacher()
  progress = ProgressBar(int(cc.num_batches), desc="cache-teacher", unit="batch",
                         enabled=bool(config.train.progress) and jax.process_index() == 0)

  def feed():
    for _ in range(int(cc.num_batches)):
      batch = next(batches)
      yield batch
      progress.update(tokens=int(np.sum(batch[batch_spec.LOSS_MASK])))

  try:
    info = write_teacher_cache(teacher, feed(), directory, top_k=top_k, temperature=temperature,
                               rows_per_file=int(cc.rows_per_file), kind=cc.kind,
                               hidden_dtype=cc.dtype,
                               place=global_batch_placer(recipe.mesh, recipe.rules),
                               fetch=_host_rows(recipe.mesh, recipe.rules),
                               vocab_limit=recipe.tokenizer.vocab_size)
  finally:
    progress.close()
  what = (f"top-{top_k} at T={temperature:g}" if cc.kind == "topk"
          else f"{cc.dtype} hidden states + LM head")
  if jax.process_index() == 0:
    provenance = {"teacher": config.teacher.to_dict(), "data": config.data.to_dict(),
                  "seed": int(config.seed), "batch_size": recipe.batch_size,
                  "seq_len": recipe.seq_len, "num_batches": int(cc.num_batches),
                  "kind": cc.kind, "top_k": top_k, "temperature": temperature,
                  "dtype": cc.dtype, "processes": jax.process_count()}
    with open(os.path.join(directory, PROVENANCE_FILE), "w") as f:
      jsonio.dump(provenance, f, indent=1, sort_keys=True)
    print(f"distillax cache-teacher: wrote {info.rows} rows ({cc.num_batches} batches of "
          f"{recipe.batch_size}x{recipe.seq_len}, {what}) to {directory}")
  return 0
