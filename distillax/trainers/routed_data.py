"""Routed data for several teachers: each data source learns from the teacher its rule names.

`distill.routes` pairs a data source (a file, dir or glob, as `data.source` takes them) with a
teacher's name. Every batch takes an equal share of rows from each source's own packed
pipeline (the `data` section with `source` replaced; its train and validation splits by
data.validation_fraction)
and carries, per token, the index of that source's teacher (TEACHER_INDEX), which the
routing objective reads. The position is each source's iterator state, together: resumable.
A route whose teacher is a hidden-state cache takes its rows from the cache, which holds them
with the teacher's states (`train_iterator_with_cache`).
"""

from __future__ import annotations

import numpy as np

from distillax.data import batch as batch_spec
from distillax.data import make_eval_iterator, make_train_iterator
from distillax.distill.multi_teacher import TEACHER_INDEX, TeacherMix
from distillax.distill.teacher_head import TEACHER_HIDDEN
from distillax.distill.training_from_cache import cached_train_iterator
from distillax.errors import ConfigError


def parse_routes(routes, mix: TeacherMix) -> tuple[tuple[str, int], ...]:
  """((source, teacher index), ...) of `distill.routes`, each teacher name checked."""
  pairs = tuple(routes or ())
  if not pairs:
    raise ConfigError("distill.teachers_mode='routing' needs distill.routes: (source, teacher) "
                      "pairs, e.g. --config.distill.routes=\"(('math/*.jsonl', 'a'), "
                      "('code/*.jsonl', 'b'))\"")
  out = []
  for pair in pairs:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
      raise ConfigError(f"distill.routes entry {pair!r} is not a (source, teacher name) pair")
    source, name = str(pair[0]), str(pair[1])
    out.append((source, mix.index_of(name, f"distill.routes entry ({source!r}, {name!r})")))
  return tuple(out)


def rows_per_route(batch_size: int, routes) -> int:
  if batch_size % len(routes):
    raise ConfigError(f"train.batch_size={batch_size} does not split evenly over the "
                      f"{len(routes)} sources of distill.routes; use a multiple of "
                      f"{len(routes)}")
  return batch_size // len(routes)


class RoutedIterator:
  """Batches of equal shares of rows from each route's iterator, with TEACHER_INDEX."""

  def __init__(self, iterators, indices):
    self.iterators, self.indices = list(iterators), list(indices)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    parts = [next(it) for it in self.iterators]  # an eval pass ends with its shortest source
    batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    batch[TEACHER_INDEX] = np.concatenate([np.full(p[batch_spec.INPUTS].shape, i, np.int32)
                                           for p, i in zip(parts, self.indices)])
    return batch

  def get_state(self) -> dict:
    return {str(n): it.get_state() for n, it in enumerate(self.iterators)}

  def set_state(self, state: dict) -> None:
    for n, it in enumerate(self.iterators):
      it.set_state(state[str(n)])


class WithZeros:
  """An iterator's batches with one more key of zeros (rows, length, *shape): what a route
  whose teacher needs nothing from the batch fills another teacher's cached column with."""

  def __init__(self, iterator, key: str, shape, dtype):
    self.iterator, self.key, self.shape, self.dtype = iterator, key, tuple(shape), dtype

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = dict(next(self.iterator))
    rows_x_length = batch[batch_spec.INPUTS].shape
    batch[self.key] = np.zeros(rows_x_length + self.shape, self.dtype)
    return batch

  def get_state(self):
    return self.iterator.get_state()

  def set_state(self, state) -> None:
    self.iterator.set_state(state)


def route_data(data_cfg, source: str):
  """The data section of one route: its source, evaluated on its own validation split."""
  out = data_cfg.copy_and_resolve_references()
  out.source = source
  out.eval_source = ""
  return out


def routed_train_iterator(data_cfg, routes, *, global_batch_size: int, seq_len: int, seed: int,
                          tokenizer) -> RoutedIterator:
  rows = rows_per_route(global_batch_size, routes)
  return RoutedIterator([make_train_iterator(route_data(data_cfg, s), global_batch_size=rows,
                                             seq_len=seq_len, seed=seed, tokenizer=tokenizer)
                         for s, _ in routes], [i for _, i in routes])


def routed_eval_iterator(data_cfg, routes, *, global_batch_size: int, seq_len: int,
                         num_batches: int, tokenizer) -> RoutedIterator:
  rows = rows_per_route(global_batch_size, routes)
  return RoutedIterator([make_eval_iterator(route_data(data_cfg, s), global_batch_size=rows,
                                            seq_len=seq_len, num_batches=num_batches,
                                            tokenizer=tokenizer)
                         for s, _ in routes], [i for _, i in routes])


def train_iterator_with_cache(data_cfg, routes, cache_dir: str, cache_index: int, hidden, *,
                              global_batch_size: int, seq_len: int, seed: int, tokenizer):
  """Train batches when the teacher of index `cache_index` is a hidden-state cache: its rows
  (routes None, a mixture: every row; routing: the rows of the route naming that teacher), with
  zero TEACHER_HIDDEN (`hidden`: its global shape and dtype) on the other routes' rows, whose
  KD reads their own teachers only."""
  if routes is None:
    return cached_train_iterator(cache_dir, global_batch_size=global_batch_size,
                                 seq_len=seq_len, seed=seed)
  rows = rows_per_route(global_batch_size, routes)
  iterators = [
      cached_train_iterator(cache_dir, global_batch_size=rows, seq_len=seq_len, seed=seed)
      if index == cache_index else
      WithZeros(make_train_iterator(route_data(data_cfg, source), global_batch_size=rows,
                                    seq_len=seq_len, seed=seed, tokenizer=tokenizer),
                TEACHER_HIDDEN, hidden.shape[2:], hidden.dtype)
      for source, index in routes]
  return RoutedIterator(iterators, [index for _, index in routes])
