"""Training from an offline teacher cache: no teacher in memory, its outputs from disk.

The cache (teacher_cache.py) is written by `distillax cache-teacher` (distillax/cache_teacher.py).
Training from it (`teacher.cache_dir`; the recipe is trainers/distill/cached.py) uses
`CachedLogitKD` (k and T from the cache) on a top-k cache, and on a hidden-state cache the
`distill.logit` section's own LogitKD (any divergence, top-k and temperature) against the
cache's TeacherHead, which stands in for the teacher (teacher_head.py); the train batches are
the cached rows (`cached_train_iterator`: a grain dataset, checkpointed and resumed like the
normal pipeline) and eval runs the normal validation split with hard-label CE, since the cache
holds nothing for it (`cached_objective` switches on whether a batch carries the cached teacher
arrays).
"""

from __future__ import annotations

import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np

from distillax.data import batch as batch_spec
from distillax.framework import vocab_chunks
from distillax.distill.base import DistillInputs, Strategy
from distillax.distill.logit_kd import TOPK_IDS, CachedLogitKD, LogitKD, logit_metric_values
from distillax.distill.objective import make_distill_objective
from distillax.distill.student import unwrap_student
from distillax.distill.teacher_cache import CacheInfo, read_teacher_cache
from distillax.distill.teacher_head import TEACHER_HIDDEN
from distillax.errors import ConfigError, UserError
from distillax.framework import losses
from distillax.framework.step import ObjectiveOutput
from distillax.models.moe import layer as moe


def cached_strategy(distill_cfg, info: CacheInfo, vocab_size: int) -> Strategy:
  """The logit strategy of the `distill` section, checked against what the cache can provide:
  CachedLogitKD on a top-k cache, LogitKD (read through the cache's head) on a hidden one."""
  if info.vocab_size != vocab_size:
    raise ConfigError(f"the teacher cache was written for vocabulary {info.vocab_size}, the "
                      f"student has {vocab_size}; set model.vocab_size={info.vocab_size}")
  holds = "only top-k logits" if info.kind == "topk" else "only final hidden states"
  for section in ("attention", "feature_pooling", "feature_projection", "router"):
    if section in distill_cfg and float(distill_cfg[section].weight) > 0:
      raise ConfigError(f"distill.{section}.weight={distill_cfg[section].weight} needs the teacher "
                        f"in memory, but teacher.cache_dir holds {holds}; set it to 0 or "
                        f"clear teacher.cache_dir")
  lc = distill_cfg.logit
  if not float(lc.weight) > 0:
    raise ConfigError("distill.logit.weight must be > 0 when training from a teacher cache (it is "
                      "the only strategy a cache supports)")
  if info.kind == "hidden":  # exact logits: any divergence, top-k and temperature
    return LogitKD(temperature=float(lc.temperature), alpha=float(lc.alpha),
                   divergence=lc.divergence, beta=float(lc.beta), top_k=int(lc.top_k) or None,
                   weight=float(lc.weight))
  if int(lc.top_k or 0) not in (0, info.top_k):
    raise ConfigError(f"distill.logit.top_k={lc.top_k} differs from the cache's top_k="
                      f"{info.top_k}; set it to {info.top_k} (or 0) or rebuild the cache")
  if abs(float(lc.temperature) - info.temperature) > 1e-9:
    raise ConfigError(f"distill.logit.temperature={lc.temperature} differs from the teacher "
                      f"cache's {info.temperature}; use --config.distill.logit.temperature="
                      f"{info.temperature} or rebuild the cache")
  return CachedLogitKD.from_cache_info(info, alpha=float(lc.alpha), divergence=lc.divergence,
                                       beta=float(lc.beta), weight=float(lc.weight))


def hard_ce_objective(student, extras, batch, rng, *, chunk_size=vocab_chunks.AUTO,
                      sliced: bool = False):
  """Student-only next-token CE with the distillation metric names (loss = hard_ce), of a
  batch without cache columns (the validation split's); `sliced`: over vocabulary slices."""
  del extras, rng
  model, _ = unwrap_student(student)
  tokens_BxL = batch[batch_spec.INPUTS]
  vocab_chunks.check_chunk_size(chunk_size)
  out = model(tokens_BxL, **losses.model_inputs(batch),
              return_logits=chunk_size is None and not sliced)
  inputs = DistillInputs(batch=batch, student=out, student_model=model, chunk_size=chunk_size)
  if sliced:
    loss = losses.model_cross_entropy_sums(model, out.final_hidden_BxLxD,
                                           batch[batch_spec.TARGETS], inputs.mask_BxL,
                                           sliced=True)[0]
    sums = {"hard_ce": jax.lax.stop_gradient(loss)}
  else:
    loss, sums = inputs.loss_and_sums(logit_metric_values, {"hard_ce": 1.0})
  tokens, ratios = jnp.sum(inputs.mask_BxL), {}
  if out.router_stats is not None:  # an MoE student's router losses and loads, unweighted
    _, router_sums, ratios = moe.objective_terms(out.router_stats, tokens, 0.0, 0.0)
    sums.update(router_sums)
  return ObjectiveOutput(loss_sum=loss, tokens=tokens, sums=sums, ratios=ratios)


def cached_objective(strategy: Strategy, *, chunk_size: int | None = vocab_chunks.AUTO,
                     metrics: bool = True,
                     router_loss_weights: tuple[float, float] = (0.0, 0.0), teachers=None,
                     sliced: bool = False):
  """Train batches (with the cached teacher arrays) get the strategy (and an MoE student's
  router losses weighted by `router_loss_weights`); eval batches from the validation split get
  hard CE. The branch is on the batch's keys, fixed at trace time.

  The cache's teacher_ce and top-1 come with the batch, so a cached train step reports them
  with metrics=True at the cost of one argmax over the student's logits (the validation split
  has no cache columns: they are reported nowhere else). `teachers`: several teachers, one of
  them the cache (multi_teacher.py). `sliced`: the LogitKD (a top-k cache's, or a hidden
  cache's through its head) and the eval batches' hard CE over vocabulary slices
  (make_distill_objective's `sliced`)."""
  distill = make_distill_objective(strategy, chunk_size=chunk_size, metrics=metrics,
                                   router_loss_weights=router_loss_weights, teachers=teachers,
                                   sliced=sliced)

  def objective(student, extras, batch, rng):
    if TOPK_IDS in batch or TEACHER_HIDDEN in batch:
      return distill(student, extras, batch, rng)
    return hard_ce_objective(student, extras, batch, rng, chunk_size=chunk_size, sliced=sliced)

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
  cached_len = int(first[batch_spec.INPUTS].shape[0])
  if cached_len != seq_len:
    raise ConfigError(f"the teacher cache {directory} holds rows of {cached_len} tokens, but "
                      f"train.seq_len={seq_len}; set --config.train.seq_len={cached_len}")
  return first


def cached_batch_shapes(directory: str, global_batch_size: int, seq_len: int):
  """Global shapes of a cached batch (the framework's keys plus the teacher's arrays)."""
  first = check_rows(directory, read_teacher_cache(directory), seq_len)
  return {k: jax.ShapeDtypeStruct((global_batch_size,) + v.shape, v.dtype)
          for k, v in first.items()}


__all__ = ["ReplayThenShuffle", "cached_batch_shapes", "cached_objective", "cached_strategy",
           "cached_train_iterator", "hard_ce_objective"]
