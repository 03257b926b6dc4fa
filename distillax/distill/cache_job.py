"""The offline teacher, end to end: `distillax cache-teacher`, then training from its cache.

  distillax cache-teacher --config distillax/configs/distill_cached.py --workdir runs/cache \
      --config.teacher.workdir=runs/teacher
  distillax train --config distillax/configs/distill_cached.py --workdir runs/kd_cached \
      --config.teacher.cache_dir=runs/cache

The job loads the teacher exactly as the distillation trainer does (the `teacher` section, through
`DistillTrainer.load_teacher`), runs it over `cache.num_batches` batches of the train pipeline and
writes their top-k (`cache.top_k`) at the distillation temperature with `write_teacher_cache`.

Training from the cache (`teacher.cache_dir`) keeps no teacher in memory: the strategy is
`CachedLogitKD` (k and T from the cache), the train batches are the cached rows
(`cached_train_iterator`: a grain dataset, checkpointed and resumed like the normal pipeline) and
eval runs the normal validation split with hard-label CE, since the cache holds nothing for it
(`cached_objective` switches on whether a batch carries the cached teacher arrays).
"""

from __future__ import annotations

import json
import os
import sys

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from distillax import partitioning as pt
from distillax.distill.base import DistillInputs, Strategy
from distillax.distill.cache import (CACHE_INFO, CacheInfo, read_teacher_cache,
                                     write_teacher_cache)
from distillax.distill.logit_kd import TOPK_IDS, CachedLogitKD, logit_metric_values
from distillax.distill.objective import make_distill_objective
from distillax.distill.student import unwrap_student
from distillax.errors import ConfigError, UserError
from distillax.framework import losses
from distillax.framework.step import ObjectiveOutput

PROVENANCE_FILE = "cache_job.json"


def default_cache_config() -> ml_collections.ConfigDict:
  """The `cache` section read by `distillax cache-teacher`."""
  c = ml_collections.ConfigDict()
  c.num_batches = 100  # train batches (train.batch_size x train.seq_len) the teacher runs over
  c.top_k = 32  # teacher tokens kept per position (the rest is one bucket of missing mass)
  c.dir = ""  # where the cache goes ('' = --workdir)
  c.rows_per_file = 4096  # rows per ArrayRecord file
  return c


# ---- the job ---------------------------------------------------------------------------------

def teacher_host(config, workdir: str):
  """A DistillTrainer with mesh, rules, tokenizer and student config resolved as `setup` does,
  but nothing compiled: what loading the teacher (and checking it against the data) needs."""
  from distillax.data import make_tokenizer
  from distillax.trainers.base import resolve_model_config
  from distillax.trainers.distill import DistillTrainer
  if "teacher" not in config:
    raise ConfigError("the config has no `teacher` section; use a distillation config such as "
                      "distillax/configs/distill_cached.py")
  trainer = DistillTrainer(config, workdir)
  trainer.mesh = pt.create_mesh(config.mesh)
  trainer.rules = pt.rules_from_config(config.partitioning)
  trainer.tokenizer = make_tokenizer(config.data.tokenizer)
  trainer.model_config = resolve_model_config(config.model, trainer.tokenizer)
  return trainer


def _cache_config(config) -> ml_collections.ConfigDict:
  out = default_cache_config()
  for key, value in (config.get("cache") or {}).items():
    if key not in out:
      raise ConfigError(f"cache.{key} is not a cache field; known: {', '.join(sorted(out))}")
    out[key] = value
  return out


def run_cache_teacher(config, workdir: str | None) -> int:
  """`distillax cache-teacher`: writes the teacher cache to cache.dir or the workdir; returns 0."""
  from distillax.data import make_train_iterator
  from distillax.framework.progress import ProgressBar

  cc = _cache_config(config)
  directory = cc.dir or workdir
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
  if "distill" not in config:
    raise ConfigError("the config has no `distill` section (its logit.temperature is the cache's "
                      "temperature); use distillax/configs/distill_cached.py")
  if int(cc.num_batches) < 1:
    raise ConfigError(f"cache.num_batches={cc.num_batches} must be >= 1")
  trainer = teacher_host(config, directory)
  teacher_cfg = trainer.teacher_config()
  if teacher_cfg is None:
    raise ConfigError("teacher.cache_dir is set, but cache-teacher writes a cache; clear "
                      "--config.teacher.cache_dir and name the teacher (teacher.workdir, "
                      "teacher.hf_path or teacher.preset)")
  top_k, temperature = int(cc.top_k), float(config.distill.logit.temperature)
  if not 0 < top_k <= teacher_cfg.vocab_size:
    raise ConfigError(f"cache.top_k={cc.top_k} must be in 1..{teacher_cfg.vocab_size} (the "
                      f"teacher vocabulary)")
  batch_size, seq_len = int(config.train.batch_size), int(config.train.seq_len)
  if seq_len > teacher_cfg.max_seq_len:
    raise ConfigError(f"train.seq_len={seq_len} exceeds the teacher's max_seq_len="
                      f"{teacher_cfg.max_seq_len}; lower train.seq_len")
  batches = make_train_iterator(config.data, global_batch_size=batch_size, seq_len=seq_len,
                                seed=int(config.seed), tokenizer=trainer.tokenizer)
  teacher = trainer.load_teacher(trainer.mesh, trainer.rules)
  progress = ProgressBar(int(cc.num_batches), desc="cache-teacher", unit="batch",
                         enabled=bool(config.train.progress))

  def feed():
    for _ in range(int(cc.num_batches)):
      batch = next(batches)
      yield batch
      progress.update(tokens=int(np.sum(batch[losses.BATCH_MASK])))

  try:
    info = write_teacher_cache(teacher, feed(), directory, top_k=top_k, temperature=temperature,
                               rows_per_file=int(cc.rows_per_file))
  finally:
    progress.close()
  provenance = {"teacher": config.teacher.to_dict(), "data": config.data.to_dict(),
                "seed": int(config.seed), "batch_size": batch_size, "seq_len": seq_len,
                "num_batches": int(cc.num_batches), "top_k": top_k, "temperature": temperature}
  with open(os.path.join(directory, PROVENANCE_FILE), "w") as f:
    json.dump(provenance, f, indent=1, sort_keys=True)
  print(f"distillax cache-teacher: wrote {info.rows} rows ({cc.num_batches} batches of "
        f"{batch_size}x{seq_len}, top-{top_k} at T={temperature:g}) to {directory}")
  return 0


# ---- training from the cache -----------------------------------------------------------------

def cached_strategy(distill_cfg, info: CacheInfo, vocab_size: int) -> CachedLogitKD:
  """CachedLogitKD from the `distill` section, checked against what the cache can provide."""
  if info.vocab_size != vocab_size:
    raise ConfigError(f"the teacher cache was written for vocabulary {info.vocab_size}, the "
                      f"student has {vocab_size}; set model.vocab_size={info.vocab_size}")
  for section in ("attention", "feature_pooling", "feature_projection"):
    if section in distill_cfg and float(distill_cfg[section].weight) > 0:
      raise ConfigError(f"distill.{section}.weight={distill_cfg[section].weight} needs the teacher "
                        f"in memory, but teacher.cache_dir holds only top-k logits; set it to 0 or "
                        f"clear teacher.cache_dir")
  lc = distill_cfg.logit
  if not float(lc.weight) > 0:
    raise ConfigError("distill.logit.weight must be > 0 when training from a teacher cache (it is "
                      "the only strategy a cache supports)")
  if int(lc.top_k or 0) not in (0, info.top_k):
    raise ConfigError(f"distill.logit.top_k={lc.top_k} differs from the cache's top_k="
                      f"{info.top_k}; set it to {info.top_k} (or 0) or rebuild the cache")
  if abs(float(lc.temperature) - info.temperature) > 1e-9:
    raise ConfigError(f"distill.logit.temperature={lc.temperature} differs from the teacher "
                      f"cache's {info.temperature}; use --config.distill.logit.temperature="
                      f"{info.temperature} or rebuild the cache")
  return CachedLogitKD.from_cache_info(info, alpha=float(lc.alpha), divergence=lc.divergence,
                                       beta=float(lc.beta), weight=float(lc.weight))


def hard_ce_objective(student, extras, batch, rng, *, chunk_size=None):
  """Student-only next-token CE with the distillation metric names (loss = hard_ce)."""
  del extras, rng
  model, _ = unwrap_student(student)
  out = model(batch[losses.BATCH_INPUTS], **losses.model_inputs(batch))
  inputs = DistillInputs(batch=batch, student=out, student_model=model, chunk_size=chunk_size)
  sums = inputs.token_sums(logit_metric_values)
  return ObjectiveOutput(loss_sum=sums["hard_ce"], tokens=jnp.sum(inputs.mask_BxL), sums=sums)


def cached_objective(strategy: Strategy, *, chunk_size: int | None = None):
  """Train batches (with the cached teacher arrays) get the strategy; eval batches from the
  validation split get hard CE. The branch is on the batch's keys, fixed at trace time."""
  distill = make_distill_objective(strategy, chunk_size=chunk_size)

  def objective(student, extras, batch, rng):
    if TOPK_IDS in batch:
      return distill(student, extras, batch, rng)
    return hard_ce_objective(student, extras, batch, rng, chunk_size=chunk_size)

  return objective


class ReplayThenShuffle(grain.MapDataset):
  """Endless rows: epoch 0 in the order written (the train pipeline's own shuffled order, so a
  cached run sees the batches the online run would), every later epoch a seeded permutation."""

  def __init__(self, parent: grain.MapDataset, seed: int):
    super().__init__(parent)
    self._seed, self._rows = int(seed), len(parent)
    self._epoch_order: tuple[int, np.ndarray] | None = None  # one permutation kept at a time

  def __len__(self) -> int:
    return sys.maxsize

  def _order(self, epoch: int) -> np.ndarray:
    if self._epoch_order is None or self._epoch_order[0] != epoch:
      order = np.random.default_rng([self._seed, epoch]).permutation(self._rows)
      self._epoch_order = (epoch, order)
    return self._epoch_order[1]

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, i = divmod(int(index), self._rows)
    return self._parent[int(self._order(epoch)[i]) if epoch else i]

  def __str__(self) -> str:
    return f"ReplayThenShuffle(seed={self._seed})"


def cached_train_iterator(directory: str, *, global_batch_size: int, seq_len: int, seed: int,
                          temperature: float | None = None) -> grain.DatasetIterator:
  """This process's share of each global batch, from the cache rows; `get_state`/`set_state`
  (a JSON dict) make it resumable like `data.make_train_iterator`."""
  from distillax.data import per_process_batch_size
  rows = read_teacher_cache(directory, temperature=temperature)
  check_rows(directory, rows, seq_len)
  process_index, process_count = jax.process_index(), jax.process_count()
  local_batch = per_process_batch_size(global_batch_size, process_count)
  rows = rows[process_index::process_count]
  if len(rows) < local_batch:
    raise UserError(f"the teacher cache {directory} has {len(rows)} rows per process, fewer than "
                    f"one batch of {local_batch}; write more (cache.num_batches) or lower "
                    f"train.batch_size")
  batches = ReplayThenShuffle(rows, seed).batch(local_batch, drop_remainder=True)
  return iter(batches.to_iter_dataset())


def check_rows(directory: str, rows: grain.MapDataset, seq_len: int) -> dict[str, np.ndarray]:
  """The first cached row, after checking its length against train.seq_len."""
  first = rows[0]
  cached_len = int(first[losses.BATCH_INPUTS].shape[0])
  if cached_len != seq_len:
    raise ConfigError(f"the teacher cache {directory} holds rows of {cached_len} tokens, but "
                      f"train.seq_len={seq_len}; set --config.train.seq_len={cached_len}")
  return first


def cached_batch_shapes(directory: str, global_batch_size: int, seq_len: int):
  """Global shapes of a cached batch (the framework's keys plus the teacher's arrays)."""
  first = check_rows(directory, read_teacher_cache(directory), seq_len)
  return {k: jax.ShapeDtypeStruct((global_batch_size,) + v.shape, v.dtype)
          for k, v in first.items()}


def build_cached_engine(trainer, learning_rate: float, quantize: bool = True):
  """`Trainer._build_engine` for cached batches, whose teacher arrays are (B, L, K)."""
  from distillax.framework import runtime
  from distillax.framework.engine import build_engine
  c = trainer.config
  optimizer_cfg = c.optimizer.copy_and_resolve_references()
  optimizer_cfg.learning_rate = learning_rate
  student, extras = trainer.build_models(trainer.mesh, trainer.rules, abstract=True,
                                         quantize=quantize)
  runtime.per_process_batch(trainer.batch_size)
  shapes = cached_batch_shapes(trainer.cache_dir, trainer.batch_size, trainer.seq_len)
  return build_engine(student, extras, trainer.objective(), optimizer_cfg, int(c.train.steps),
                      trainer.mesh, trainer.rules, c.backend, shapes,
                      accum_steps=int(c.train.accum_steps), trainable=trainer.trainable(),
                      gradient_reduction=str(c.partitioning.get("gradient_reduction", "auto")))


__all__ = ["ReplayThenShuffle", "build_cached_engine", "cached_batch_shapes", "cached_objective",
           "cached_strategy", "cached_train_iterator", "default_cache_config",
           "hard_ce_objective", "run_cache_teacher", "teacher_host"]
