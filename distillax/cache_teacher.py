"""`distillax cache-teacher`: run the teacher once, store its top-k, train without it later.

  distillax cache-teacher --config distillax/configs/distill_cached.py --workdir runs/cache \
      --config.teacher.workdir=runs/teacher
  distillax train --config distillax/configs/distill_cached.py --workdir runs/kd_cached \
      --config.teacher.cache_dir=runs/cache

The job asks the distillation recipe for the teacher (the `teacher` section, through the one
`load_teacher`), runs it over `cache.num_batches` batches of the train pipeline and writes their
top-k (`cache.top_k`) at the distillation temperature with `write_teacher_cache`. Training from
the cache is the cached-distillation recipe (trainers/distill_cached.py).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from distillax.data import batch as batch_spec
from distillax.distill.teacher_cache import CACHE_INFO, write_teacher_cache
from distillax.errors import ConfigError, UserError
from distillax.framework import jsonio
from distillax.framework.progress import ProgressBar
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
  if jax.process_count() > 1:
    raise UserError("cache-teacher runs in one process (it writes every row itself); launch it "
                    "without --num_processes")
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


def run_cache_teacher(config, workdir: str | None, *, model_overrides=None) -> int:
  """Writes the teacher cache to cache.dir or the workdir; returns 0."""
  directory = _check(config, workdir)
  cc = config.cache
  recipe = recipe_for(config, model_overrides=model_overrides)
  if not isinstance(recipe, DistillRecipe):
    raise ConfigError(f"cache-teacher needs trainer='distill', not {config.trainer!r}")
  teacher_cfg = recipe.teacher_model_config
  top_k, temperature = int(cc.top_k), float(config.distill.logit.temperature)
  if not 0 < top_k <= teacher_cfg.vocab_size:
    raise ConfigError(f"cache.top_k={cc.top_k} must be in 1..{teacher_cfg.vocab_size} (the "
                      f"teacher vocabulary)")
  if recipe.seq_len > teacher_cfg.max_seq_len:
    raise ConfigError(f"train.seq_len={recipe.seq_len} exceeds the teacher's max_seq_len="
                      f"{teacher_cfg.max_seq_len}; lower train.seq_len")
  check_recipe_data(recipe)
  batches = recipe.train_iterator()
  teacher = recipe.load_teacher()
  progress = ProgressBar(int(cc.num_batches), desc="cache-teacher", unit="batch",
                         enabled=bool(config.train.progress))

  def feed():
    for _ in range(int(cc.num_batches)):
      batch = next(batches)
      yield batch
      progress.update(tokens=int(np.sum(batch[batch_spec.LOSS_MASK])))

  try:
    info = write_teacher_cache(teacher, feed(), directory, top_k=top_k, temperature=temperature,
                               rows_per_file=int(cc.rows_per_file))
  finally:
    progress.close()
  provenance = {"teacher": config.teacher.to_dict(), "data": config.data.to_dict(),
                "seed": int(config.seed), "batch_size": recipe.batch_size,
                "seq_len": recipe.seq_len, "num_batches": int(cc.num_batches), "top_k": top_k,
                "temperature": temperature}
  with open(os.path.join(directory, PROVENANCE_FILE), "w") as f:
    jsonio.dump(provenance, f, indent=1, sort_keys=True)
  print(f"distillax cache-teacher: wrote {info.rows} rows ({cc.num_batches} batches of "
        f"{recipe.batch_size}x{recipe.seq_len}, top-{top_k} at T={temperature:g}) to {directory}")
  return 0
