"""Routed data for several teachers: each data source learns from the teacher its rule names.

`distill.routes` pairs a data source (a file, dir or glob, as `data.source` takes them) with a
teacher's name. Every batch takes an equal share of rows from each source's own packed
pipeline (the `data` section with `source` replaced; its train and validation splits by
data.validation_fraction)
and carries, per token, the index of that source's teacher (TEACHER_INDEX), which the
routing objective reads. The position is each source's iterator state, together: resumable.
"""

from __future__ import annotations

import numpy as np

from distillax.data import batch as batch_spec
from distillax.data import make_eval_iterator, make_train_iterator
from distillax.distill.multi_teacher import TEACHER_INDEX, TeacherMix
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
