"""Per-token losses over logits: on the whole batch, or a chunk of tokens at a time.

A token-level function `fn(student_logits_NxV, teacher_logits_NxV | None, tokens) -> {name: (N,)}`
sees N flattened token positions; `tokens` holds every batch entry of leading shape (B, L),
flattened to (N, ...) (targets, loss mask, cached teacher top-k, ...). Both paths return the sums
of each value over the real tokens (loss_mask_BxL > 0).

The chunked path never builds the full [B*L, V] fp32 logits of either model: it takes the final
hidden states, splits the N = B*L positions into chunks of `chunk_size` tokens, and for each chunk
computes the student's and the teacher's logits together (`model.logits_from_hidden`), evaluates
`fn` and adds the sums (`lax.scan`). The chunk body is wrapped in `jax.checkpoint`, so the
backward pass recomputes one chunk's logits at a time instead of keeping every chunk's.
Under `jit`, the logits the model's forward also returns are unused on this path and removed by
XLA's dead-code elimination.

Chunk i takes the positions {i, i + n, i + 2n, ...} (n chunks): each chunk draws evenly from
every row, so a batch-sharded (data-parallel) array stays sharded inside every chunk rather than
one chunk living on one device. The order of a sum does not change its value (up to rounding).
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.errors import ConfigError
from distillax.framework import losses


def flatten_tokens(batch: Mapping[str, jax.Array], B: int, L: int) -> dict[str, jax.Array]:
  """Every batch entry shaped (B, L, ...) as (B*L, ...)."""
  return {k: v.reshape((B * L,) + v.shape[2:]) for k, v in batch.items()
          if hasattr(v, "shape") and tuple(v.shape[:2]) == (B, L)}


def _masked_sums(values: Mapping[str, jax.Array], mask_N: jax.Array) -> dict[str, jax.Array]:
  keep = mask_N > 0
  return {k: jnp.sum(jnp.where(keep, v.astype(jnp.float32), 0.0)) for k, v in values.items()}


def full_token_sums(fn, batch, student_out, teacher_out) -> dict[str, jax.Array]:
  """The unchunked path: `fn` on the logits the forward passes returned."""
  mask_BxL = batch[losses.BATCH_MASK]
  B, L = mask_BxL.shape
  tokens = flatten_tokens(batch, B, L)
  s_NxV = student_out.logits_BxLxV.reshape(B * L, -1)
  t_NxV = None
  if teacher_out is not None:
    t_NxV = jax.lax.stop_gradient(teacher_out.logits_BxLxV.reshape(B * L, -1))
  return _masked_sums(fn(s_NxV, t_NxV, tokens), tokens[losses.BATCH_MASK])


def chunked_token_sums(fn, batch, student_out, teacher_out, student_model, teacher_model,
                       chunk_size: int) -> dict[str, jax.Array]:
  """The same sums as `full_token_sums`, with logits computed `chunk_size` tokens at a time."""
  if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
    raise ConfigError(f"distill chunk_size={chunk_size!r} must be a positive number of tokens "
                      f"(or None for unchunked logits)")
  if student_model is None or (teacher_out is not None and teacher_model is None):
    raise ConfigError("chunked logit losses need the student and teacher models "
                      "(DistillInputs.student_model / teacher_model) to compute logits")
  mask_BxL = batch[losses.BATCH_MASK]
  B, L = mask_BxL.shape
  N = B * L
  num_chunks = math.ceil(N / chunk_size)
  size = math.ceil(N / num_chunks)  # <= chunk_size; pads fewer than num_chunks positions
  padded = num_chunks * size

  xs = flatten_tokens(batch, B, L)
  xs["__student_hidden"] = student_out.final_hidden_BxLxD.reshape(N, -1)
  if teacher_out is not None:
    xs["__teacher_hidden"] = jax.lax.stop_gradient(teacher_out.final_hidden_BxLxD.reshape(N, -1))

  def to_chunks(x):  # (N, ...) -> (num_chunks, size, ...), chunk i = positions i, i + n, ...
    x = jnp.pad(x, [(0, padded - N)] + [(0, 0)] * (x.ndim - 1))  # padding has loss mask 0
    return jnp.swapaxes(x.reshape((size, num_chunks) + x.shape[1:]), 0, 1)

  xs = {k: to_chunks(v) for k, v in xs.items()}
  s_graph, s_state = nnx.split(student_model)
  t_graph, t_state = (None, None) if teacher_out is None else nnx.split(teacher_model)
  if t_state is not None:
    t_state = jax.lax.stop_gradient(t_state)

  @jax.checkpoint
  def chunk_sums(s_state, t_state, chunk):
    tokens = {k: v for k, v in chunk.items() if not k.startswith("__")}
    s_CxV = nnx.merge(s_graph, s_state).logits_from_hidden(chunk["__student_hidden"])
    t_CxV = None
    if t_state is not None:
      t_CxV = jax.lax.stop_gradient(
          nnx.merge(t_graph, t_state).logits_from_hidden(chunk["__teacher_hidden"]))
    return _masked_sums(fn(s_CxV, t_CxV, tokens), tokens[losses.BATCH_MASK])

  first = jax.tree.map(lambda x: x[0], xs)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       jax.eval_shape(chunk_sums, s_state, t_state, first))

  def body(total, chunk):
    return jax.tree.map(jnp.add, total, chunk_sums(s_state, t_state, chunk)), None

  total, _ = jax.lax.scan(body, zeros, xs)
  return total
