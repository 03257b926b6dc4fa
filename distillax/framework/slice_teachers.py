"""The teacher side of the vocabulary slices (vocab_slices.py): one teacher's head, or several
teachers' heads folded into one teacher per token, as distill/multi_teacher.TeacherMix folds
whole logits, one slice of columns at a time, or a table of the teacher's logits:

  one      t = the head's logits
  table    t = the table's columns (a top-k cache of every id, in vocabulary order: `Table`)
  routing  t_n = the logits of token n's own teacher (index_N, clipped to the teachers): every
           teacher's slice is made, each row takes its teacher's
  mixture  t = T log sum_i w_i softmax(t_i / T), the logits whose softmax at the mixture's T is
           the mixture itself (weights normalised; a weight of 0 drops its teacher). Each
           teacher's log-sum-exp at T over the counted columns is needed before any slice of t:
           `operands` makes them in a pass of their own over the teachers' slices (no gradient:
           a teacher is frozen), one more pass of the teachers' matmuls than one teacher costs.
           Still the faster schedule on a TPU v5e: the KD loss's value and gradient (student head
           and hidden states) over 16,384 positions of a 151,936 vocabulary, a 1024-wide student,
           2048-wide teachers, bf16 matmuls, took 748 ms with two teachers mixed against 1,108
           over token chunks (vocab_chunks.py), and 298 against 421 with one (a throwaway timing,
           not a benchmark row; 4,096 positions, one teacher: 83 against 107).

Every teacher's softmax is over the student's counted columns (a padded vocabulary's columns
past the tokens left out of each), so the fold is the one over whole logits cut to those columns.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from distillax.framework.slice_divergences import lse_step
from distillax.framework.slice_heads import Head, new_columns, parts, sliced_parts, slices
from distillax.framework.slice_heads import logits as slice_logits

MODES = ("routing", "mixture")


@dataclasses.dataclass(frozen=True)
class Teachers:
  """Several teachers' heads and their flat inputs (N, D_i), folded as `mode` says; `index_N`:
  each token's teacher (routing); `weights` and `temperature`: the mixture's."""

  heads: tuple
  inputs: tuple
  mode: str = "mixture"
  weights: tuple = ()
  temperature: float = 1.0
  index_N: Any = None

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"teachers mode {self.mode!r}; choose one of {', '.join(MODES)}")
    if self.mode == "routing" and self.index_N is None:
      raise ValueError("routing needs each token's teacher (index_N)")


@dataclasses.dataclass(frozen=True)
class Table:
  """A teacher given as its logits (N, V) in vocabulary order rather than a head: a top-k cache
  that keeps every id, scattered once into a table the size of the cache (its log-probs at T
  times T are logits whose softmax at T is the cache's distribution). Each slice reads its
  columns."""

  logits_NxV: Any


@dataclasses.dataclass(frozen=True)
class Static:
  """What the passes read of the teachers beside their arrays (hashable): each head's (vocab
  axes, dtype, soft-cap), the fold, the mixture's temperature and log-weights."""

  heads: tuple
  mode: str = "one"
  temperature: float = 1.0
  log_weights: tuple = ()


def operands(teacher, h_t_NxD, size: int, vocab: int, columns: int):
  """(Static, weights, inputs) of the teacher side, behind stop_gradient: `inputs` holds each
  head's matmul inputs and what the fold reads per token (routing's index, the mixture's
  log-sum-exps, made here over the slices of `size` columns of a `vocab`-column student)."""
  if isinstance(teacher, Table):
    return Static((), "table"), (), ((), {"table": jax.lax.stop_gradient(teacher.logits_NxV)})
  if isinstance(teacher, Head):
    teacher = Teachers((teacher,), (h_t_NxD,))
  per = [parts(head, h) for head, h in zip(teacher.heads, teacher.inputs)]
  weights = jax.lax.stop_gradient(tuple(w for w, _, _ in per))
  inputs = jax.lax.stop_gradient(tuple(x for _, x, _ in per))
  heads = tuple((axes, head.dtype, head.softcap) for (_, _, axes), head in zip(per, teacher.heads))
  K = len(heads)
  if K == 1:  # one teacher, however named, is itself (TeacherMix.combine's K = 1)
    return Static(heads), weights, (inputs, {})
  if teacher.mode == "routing":
    index = jnp.clip(teacher.index_N.astype(jnp.int32), 0, K - 1)
    return Static(heads, "routing"), weights, (inputs, {"index": index})
  total = sum(float(w) for w in teacher.weights) if teacher.weights else float(K)
  log_w = tuple(math.log(float(w) / total) if float(w) > 0 else -math.inf
                for w in (teacher.weights or (1.0,) * K))
  static = Static(heads, "mixture", float(teacher.temperature), log_w)
  return static, weights, (inputs, {"lse": _normalisers(static, weights, inputs, size, vocab,
                                                        columns)})


def _each(static: Static, weights, inputs, start, size: int):
  """Every teacher's fp32 logits of the slice starting at `start`."""
  return [slice_logits(sliced_parts(w, start, size, axes), h, axes, dtype, cap)
          for w, h, (axes, dtype, cap) in zip(weights, inputs, static.heads)]


def logits(static: Static, weights, inputs_and_fold, start, size: int):
  """The one teacher's fp32 logits (N, size) of the slice starting at `start`."""
  inputs, fold = inputs_and_fold
  if static.mode == "table":
    return jax.lax.dynamic_slice_in_dim(fold["table"], start, size, axis=1)
  each = _each(static, weights, inputs, start, size)
  if static.mode == "one":
    return each[0]
  if static.mode == "routing":
    t = each[0]
    for k in range(1, len(each)):
      t = jnp.where((fold["index"] == k)[:, None], each[k], t)
    return t
  T = static.temperature
  z = jnp.stack([lw + t_k / T - fold["lse"][:, k, None]
                 for k, (lw, t_k) in enumerate(zip(static.log_weights, each))])
  return T * jax.nn.logsumexp(z, axis=0)


def _normalisers(static: Static, weights, inputs, size: int, vocab: int, columns: int):
  """(N, K): each teacher's logsumexp(t_k / T) over the counted columns, one pass over the
  slices."""
  count, starts = slices(vocab, size)
  N, K, T = inputs[0][0].shape[0], len(static.heads), static.temperature

  def body(carry, xs):
    j, start = xs
    new = new_columns(j, start, size, columns)
    m, l = carry
    pairs = [lse_step(m[k], l[k], jnp.where(new, t / T, -jnp.inf))
             for k, t in enumerate(_each(static, weights, inputs, start, size))]
    return (jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs])), None

  init = (jnp.full((K, N), -jnp.inf, jnp.float32), jnp.zeros((K, N), jnp.float32))
  m, l = jax.lax.scan(body, init, (jnp.arange(count), starts))[0]
  return (m + jnp.log(l)).T
