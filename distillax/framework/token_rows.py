"""Which rows of a model's vocabulary are tokens, for the token losses.

A model's vocabulary is padded past its tokenizer's (to a multiple of 128, so it shards evenly:
lm.py:tiny's 384 rows over the byte tokenizer's 259 ids). No text ever names a padded row, and
every export (Hugging Face, GGUF) drops them (export.real_token_rows). A softmax over all rows
gives them mass all the same, so a run that counted them reported an eval_loss higher than its
export's by up to log(V / tokens) (log(512 / 500) for a 500-id tokenizer): two figures for one
model. The losses therefore take their softmax over the tokenizer's rows only.

The recipe knows the tokenizer and wraps its objectives (`over_token_rows`); the loss helpers
that build an output layer for the two vocabulary engines read the number while the objective
is traced (`active`) and hand it to the engine, which masks the padded columns inside each chunk
or slice (no extra (tokens, V) array). Outside a recipe (a bare objective in a test or a
benchmark) nothing is masked. The masked value is finite: a divergence's 0 * log 0 stays 0.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from distillax.framework.step import Objective, ObjectiveFn, as_objective

# A padded column's logit: exp() of it is 0 next to any real logit (float32's exp underflows
# below -104), and, unlike -inf, it keeps p * (log p - log q) at 0 where both models mask the
# column, and a square of it finite (a metric over raw logits reads them through `zeroed`).
MASKED_LOGIT = -1e4

_TOKEN_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "distillax_token_rows", default=None)


def active() -> int | None:
  """The number of token rows the losses traced now take their softmax over (None: all)."""
  return _TOKEN_ROWS.get()


@contextlib.contextmanager
def limited_to(rows: int | None):
  """Losses traced inside take their softmax over the first `rows` rows of the vocabulary."""
  token = _TOKEN_ROWS.set(None if rows is None else int(rows))
  try:
    yield
  finally:
    _TOKEN_ROWS.reset(token)


def over_token_rows(objective: Objective | ObjectiveFn, rows: int | None) -> Objective:
  """The objective with its token losses over the tokenizer's `rows` ids (flags kept; the
  number recorded as its `token_rows`)."""

  def wrap(fn: ObjectiveFn) -> ObjectiveFn:
    def objective_over_token_rows(student, extras, batch, rng):
      with limited_to(rows):
        return fn(student, extras, batch, rng)
    return objective_over_token_rows

  wrapped = as_objective(objective).wrapped(wrap)
  return dataclasses.replace(wrapped, token_rows=None if rows is None else int(rows))


def effective(rows: int | None, vocab: int) -> int | None:
  """`rows` where it masks something of a `vocab`-row output layer, else None (a tokenizer as
  large as the table, or larger: Gemma 3's one unused special past the 1B's 262,144 rows)."""
  return None if rows is None or rows >= vocab else int(rows)


def masked(logits_NxV: jax.Array, rows: int | None) -> jax.Array:
  """`logits_NxV` with the columns at or past `rows` set to MASKED_LOGIT (no gradient)."""
  rows = effective(rows, logits_NxV.shape[-1])
  if rows is None:
    return logits_NxV
  is_token_V = jnp.arange(logits_NxV.shape[-1]) < rows
  return jnp.where(is_token_V, logits_NxV, jnp.asarray(MASKED_LOGIT, logits_NxV.dtype))


def zeroed(logits_NxV: jax.Array) -> jax.Array:
  """`logits_NxV` with its masked columns 0, for a metric over raw logits (a cosine) to see the
  token columns alone."""
  return jnp.where(logits_NxV == jnp.asarray(MASKED_LOGIT, logits_NxV.dtype), 0, logits_NxV)


def masked_logits_fn(logits_fn: Callable, rows: int | None) -> Callable:
  """An output layer's `logits_fn(params, h)` whose padded columns are masked."""
  if rows is None:
    return logits_fn
  return lambda params, h: masked(logits_fn(params, h), rows)
