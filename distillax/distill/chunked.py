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

The objective's loss goes through `fused_loss_sums`: the same chunks, but each chunk's backward
(the gradient of the weighted loss with respect to the student's logits, and from it with
respect to the student's hidden states and output layer) runs inside the forward scan, while
the chunk's logits are at hand. The backward pass then only scales those gradients by the
incoming cotangent: neither model's logits are computed a second time (rematerialising them, as
`chunked_token_sums` under `jax.checkpoint` does, costs one more output-layer matmul of each
model per step, the teacher's being the larger).

Chunk size: `AUTO` (-1, the config default) picks `auto_chunk_size`: the most tokens whose fp32
logits of one model, tokens x V x 4 bytes, fit CHUNK_BUDGET_BYTES (at least 1, at most the
tokens of the batch); a chunk's loss and gradient hold a few such arrays at a time.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.data import batch as batch_spec
from distillax.errors import ConfigError

AUTO = -1  # chunk_size: pick it from the vocabulary and the batch (auto_chunk_size)
CHUNK_BUDGET_BYTES = 128 * 2**20  # one model's fp32 logits of one chunk


def auto_chunk_size(num_tokens: int, vocab_size: int,
                    budget_bytes: int = CHUNK_BUDGET_BYTES) -> int:
  """Tokens per chunk: the most whose fp32 logits (tokens x V x 4 bytes) fit `budget_bytes`,
  between 1 and `num_tokens` (a small vocabulary gets the whole batch as one chunk)."""
  return max(1, min(int(num_tokens), int(budget_bytes) // (4 * int(vocab_size))))


def check_chunk_size(chunk_size) -> None:
  """None (unchunked), AUTO, or a positive number of tokens."""
  if chunk_size is None:
    return
  if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or (
      chunk_size <= 0 and chunk_size != AUTO):
    raise ConfigError(f"distill chunk_size={chunk_size!r} must be a positive number of tokens, "
                      f"{AUTO} (auto: from the vocabulary and the batch) or None (unchunked)")


def chunk_size_from_config(value) -> int | None:
  """`distill.chunk_size` as the objective takes it: 0 = unchunked (None), -1 = AUTO, n > 0."""
  value = int(value)
  if value == 0:
    return None
  check_chunk_size(value)
  return value


def resolve_chunk_size(chunk_size, num_tokens: int, vocab_size: int) -> int | None:
  """AUTO -> auto_chunk_size(num_tokens, vocab_size); None and explicit sizes unchanged."""
  check_chunk_size(chunk_size)
  return auto_chunk_size(num_tokens, vocab_size) if chunk_size == AUTO else chunk_size


def flatten_tokens(batch: Mapping[str, jax.Array], B: int, L: int) -> dict[str, jax.Array]:
  """Every batch entry shaped (B, L, ...) as (B*L, ...)."""
  return {k: v.reshape((B * L,) + v.shape[2:]) for k, v in batch.items()
          if hasattr(v, "shape") and tuple(v.shape[:2]) == (B, L)}


def _masked_sums(values: Mapping[str, jax.Array], mask_N: jax.Array) -> dict[str, jax.Array]:
  keep = mask_N > 0
  return {k: jnp.sum(jnp.where(keep, v.astype(jnp.float32), 0.0)) for k, v in values.items()}


def full_token_sums(fn, batch, student_out, teacher_out) -> dict[str, jax.Array]:
  """The unchunked path: `fn` on the logits the forward passes returned."""
  mask_BxL = batch[batch_spec.LOSS_MASK]
  B, L = mask_BxL.shape
  tokens = flatten_tokens(batch, B, L)
  s_NxV = student_out.logits_BxLxV.reshape(B * L, -1)
  t_NxV = None
  if teacher_out is not None:
    t_NxV = jax.lax.stop_gradient(teacher_out.logits_BxLxV.reshape(B * L, -1))
  return _masked_sums(fn(s_NxV, t_NxV, tokens), tokens[batch_spec.LOSS_MASK])


def _check_chunk_inputs(student_out, teacher_out, student_model, teacher_model, chunk_size):
  if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
    raise ConfigError(f"distill chunk_size={chunk_size!r} must be a positive number of tokens "
                      f"(or None for unchunked logits)")
  if student_model is None or (teacher_out is not None and teacher_model is None):
    raise ConfigError("chunked logit losses need the student and teacher models "
                      "(DistillInputs.student_model / teacher_model) to compute logits")


def _chunked_inputs(batch, student_out, teacher_out, chunk_size: int) -> dict[str, jax.Array]:
  """Token entries and final hidden states as (num_chunks, size, ...); "__"-prefixed keys are
  the hidden states, the rest the flattened batch."""
  mask_BxL = batch[batch_spec.LOSS_MASK]
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

  return {k: to_chunks(v) for k, v in xs.items()}


def _teacher_split(teacher_out, teacher_model):
  if teacher_out is None:
    return None, None
  t_graph, t_state = nnx.split(teacher_model)
  return t_graph, jax.lax.stop_gradient(t_state)


def _teacher_logits(t_graph, t_state, hidden_CxD):
  if t_state is None:
    return None
  return jax.lax.stop_gradient(nnx.merge(t_graph, t_state).logits_from_hidden(hidden_CxD))


def _zeros_like_tree(tree):
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def chunked_token_sums(fn, batch, student_out, teacher_out, student_model, teacher_model,
                       chunk_size: int) -> dict[str, jax.Array]:
  """The same sums as `full_token_sums`, with logits computed `chunk_size` tokens at a time."""
  _check_chunk_inputs(student_out, teacher_out, student_model, teacher_model, chunk_size)
  xs = _chunked_inputs(batch, student_out, teacher_out, chunk_size)
  s_graph, s_state = nnx.split(student_model)
  t_graph, t_state = _teacher_split(teacher_out, teacher_model)

  @jax.checkpoint
  def chunk_sums(s_state, t_state, chunk):
    tokens = {k: v for k, v in chunk.items() if not k.startswith("__")}
    s_CxV = nnx.merge(s_graph, s_state).logits_from_hidden(chunk["__student_hidden"])
    t_CxV = _teacher_logits(t_graph, t_state, chunk.get("__teacher_hidden"))
    return _masked_sums(fn(s_CxV, t_CxV, tokens), tokens[batch_spec.LOSS_MASK])

  first = jax.tree.map(lambda x: x[0], xs)
  zeros = _zeros_like_tree(jax.eval_shape(chunk_sums, s_state, t_state, first))

  def body(total, chunk):
    return jax.tree.map(jnp.add, total, chunk_sums(s_state, t_state, chunk)), None

  total, _ = jax.lax.scan(body, zeros, xs)
  return total


def _weighted_loss(sums: Mapping[str, jax.Array], weights: Mapping[str, float]) -> jax.Array:
  return sum((w * sums[k] for k, w in weights.items()), jnp.zeros((), jnp.float32))


def fused_loss_sums(fn, weights: Mapping[str, float], batch, student_out, teacher_out,
                    student_model, teacher_model, chunk_size: int
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(sum of weights[k] * sums[k], sums) over chunks, sums as in `chunked_token_sums`.

  Only the loss is differentiable (the sums come back behind stop_gradient: metrics). Under
  differentiation the forward scan also forms, chunk by chunk, the loss's gradient with respect
  to the student's final hidden states and its (inexact) parameters, which the backward pass
  scales by the loss's cotangent; without differentiation no gradient is computed.
  """
  _check_chunk_inputs(student_out, teacher_out, student_model, teacher_model, chunk_size)
  xs = _chunked_inputs(batch, student_out, teacher_out, chunk_size)
  s_hidden = xs.pop("__student_hidden")
  t_hidden = xs.pop("__teacher_hidden", None)
  s_graph, s_state = nnx.split(student_model)
  t_graph, t_state = _teacher_split(teacher_out, teacher_model)
  params = _SplitParams(s_state)

  def chunk_value(diff, h_CxD, rest, t_state, t_h_CxD, tokens):
    student = nnx.merge(s_graph, params.join(diff, rest))
    s_CxV = student.logits_from_hidden(h_CxD)
    t_CxV = _teacher_logits(t_graph, t_state, t_h_CxD)
    sums = _masked_sums(fn(s_CxV, t_CxV, tokens), tokens[batch_spec.LOSS_MASK])
    return _weighted_loss(sums, weights), sums

  scan = functools.partial(_fused_scan, chunk_value)

  @jax.custom_vjp
  def fused(diff, hidden, rest, t_state, t_hidden, xs):
    sums, _ = scan(False, diff, hidden, rest, t_state, t_hidden, xs)
    return _weighted_loss(sums, weights), sums

  def fused_fwd(diff, hidden, rest, t_state, t_hidden, xs):
    sums, grads = scan(True, diff, hidden, rest, t_state, t_hidden, xs)
    return (_weighted_loss(sums, weights), sums), grads

  dtypes = [p.dtype for p in params.diff]

  def fused_bwd(grads, cotangents):
    g_diff32, g_hidden = grads
    ct_loss = cotangents[0]  # the sums are metrics (stop_gradient below): no cotangent
    g_diff = [(ct_loss * g).astype(dtype) for g, dtype in zip(g_diff32, dtypes)]
    return g_diff, (ct_loss * g_hidden).astype(g_hidden.dtype), None, None, None, None

  fused.defvjp(fused_fwd, fused_bwd)
  loss, sums = fused(params.diff, s_hidden, params.rest, t_state, t_hidden, xs)
  return loss, jax.tree.map(jax.lax.stop_gradient, sums)


def _fused_scan(chunk_value, with_grad: bool, diff, hidden, rest, t_state, t_hidden, xs):
  """(sums, None) or (sums, (gradient of the loss w.r.t. diff in fp32, w.r.t. hidden)) over
  the chunks of `xs` (leading axis), one `chunk_value` evaluation per chunk."""
  def args(i_chunk):
    h, t_h, tokens = i_chunk
    return h, rest, t_state, t_h, tokens

  per_chunk = (hidden, t_hidden, xs)
  first = jax.tree.map(lambda x: x[0], per_chunk)
  sums0 = _zeros_like_tree(jax.eval_shape(lambda *a: chunk_value(diff, *a)[1], *args(first)))
  if not with_grad:
    def body(total, chunk):
      sums = chunk_value(diff, *args(chunk))[1]
      return jax.tree.map(jnp.add, total, sums), None
    return jax.lax.scan(body, sums0, per_chunk)[0], None

  grad = jax.value_and_grad(chunk_value, argnums=(0, 1), has_aux=True)
  g0 = [jnp.zeros(p.shape, jnp.float32) for p in diff]

  def grad_body(carry, chunk):
    total, g_total = carry
    (_, sums), (g_diff, g_h) = grad(diff, *args(chunk))
    g_total = [a + g.astype(jnp.float32) for a, g in zip(g_total, g_diff)]
    return (jax.tree.map(jnp.add, total, sums), g_total), g_h

  (sums, g_diff), g_hidden = jax.lax.scan(grad_body, (sums0, g0), per_chunk)
  return sums, (g_diff, g_hidden)


class _SplitParams:
  """A module state's leaves split into the differentiable (inexact dtype) ones and the rest
  (integer counters, keys), and joined back."""

  def __init__(self, state):
    leaves, self.treedef = jax.tree.flatten(state)
    self.is_diff = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]
    self.diff = [x for x, d in zip(leaves, self.is_diff) if d]
    self.rest = [x for x, d in zip(leaves, self.is_diff) if not d]

  def join(self, diff, rest):
    diff, rest = iter(diff), iter(rest)
    leaves = [next(diff) if d else next(rest) for d in self.is_diff]
    return jax.tree.unflatten(self.treedef, leaves)
