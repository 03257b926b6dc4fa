"""Next-token cross-entropy over chunks of the sequence: the (B, L, V) fp32 logits never exist.

The L positions of every row are split into chunks; chunk j takes positions j, j + n, j + 2n, ...
(n chunks), so an array sharded along the batch or the length (sequence parallelism) stays
sharded inside every chunk. Each chunk's (B, C, V) logits come from the model's output layer
(`logits_fn(params, hidden_BxCxD)`), and their loss and accuracy are summed.

Under differentiation each chunk's gradient, with respect to its hidden states and to the
output-layer parameters, is formed in the same forward pass while the chunk's logits are at
hand (a custom VJP); the backward pass only scales those gradients by the loss's cotangent, so
no logits are computed twice. Only the parameters `logits_fn` reads carry a gradient accumulator
(found from its jaxpr), not the whole model.

Chunk length: the most positions whose fp32 logits fit CHUNK_BUDGET_BYTES on one device, the
device's share taken from the active partitioning rules (batch and vocab shards).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from distillax import partitioning as pt
from distillax.framework.losses import cross_entropy_sums

CHUNK_BUDGET_BYTES = 128 * 2**20  # fp32 logits of one chunk on one device


def auto_chunk_len(batch: int, length: int, vocab: int) -> int:
  """Positions per chunk whose (batch, chunk, vocab) fp32 logits fit the budget per device."""
  active = pt.active_rules()
  rows, cols = batch, vocab
  if active is not None:
    spec = active.rules.resolve(("batch", "length", "vocab"), (batch, length, vocab),
                                active.mesh, "chunked loss logits")
    size = lambda axes: math.prod(active.mesh.shape[a] for a in pt.axes_tuple(axes))
    rows, cols = batch // size(spec[0]), vocab // size(spec[2])
  return max(1, min(length, CHUNK_BUDGET_BYTES // (4 * rows * cols)))


def _to_chunks(x_BxL, n: int):
  """(B, L, ...) -> (n, B, C, ...), chunk j = positions j, j + n, ...; L padded to n * C."""
  B, L = x_BxL.shape[:2]
  C = math.ceil(L / n)
  x = jnp.pad(x_BxL, [(0, 0), (0, n * C - L)] + [(0, 0)] * (x_BxL.ndim - 2))
  return jnp.moveaxis(x.reshape(B, C, n, *x.shape[2:]), 2, 0)


def _used_leaves(logits_fn, params, h_BxCxD) -> list[bool]:
  """Which leaves of `params` the output layer reads (the rest get no gradient accumulator)."""
  leaves, treedef = jax.tree.flatten(params)
  fn = lambda leaves, h: logits_fn(jax.tree.unflatten(treedef, leaves), h)
  closed = jax.make_jaxpr(fn)(leaves, h_BxCxD)
  used = {v for eqn in closed.jaxpr.eqns for v in eqn.invars if not hasattr(v, "val")}
  used |= {v for v in closed.jaxpr.outvars if not hasattr(v, "val")}
  return [v in used for v in closed.jaxpr.invars[:len(leaves)]]


def _split(params, h_BxCxD, logits_fn):
  leaves, treedef = jax.tree.flatten(params)
  used = _used_leaves(logits_fn, params, h_BxCxD)
  is_diff = [u and jnp.issubdtype(x.dtype, jnp.inexact) for x, u in zip(leaves, used)]
  diff = [x for x, d in zip(leaves, is_diff) if d]
  rest = [x for x, d in zip(leaves, is_diff) if not d]

  def join(diff, rest):
    diff, rest = iter(diff), iter(rest)
    return jax.tree.unflatten(treedef, [next(diff) if d else next(rest) for d in is_diff])

  return diff, rest, join


def _chunk_scan(logits_fn, join, with_grad: bool, diff, rest, chunks):
  """Sums over the chunks; with_grad: also the gradient w.r.t. diff (fp32, accumulated) and
  each chunk's hidden states (stacked)."""

  def chunk(diff, h, t, m):
    loss, correct, _ = cross_entropy_sums(logits_fn(join(diff, rest), h), t, m)
    return loss, correct

  grad = jax.value_and_grad(chunk, argnums=(0, 1), has_aux=True)
  zero = jnp.zeros((), jnp.float32)

  def body(carry, xs):
    loss, correct, g = carry
    if not with_grad:
      l, c = chunk(diff, *xs)
      return (loss + l, correct + c, g), None
    (l, c), (g_diff, g_h) = grad(diff, *xs)
    g = [a + b.astype(jnp.float32) for a, b in zip(g, g_diff)]
    return (loss + l, correct + c, g), g_h

  g0 = [jnp.zeros(p.shape, jnp.float32) for p in diff] if with_grad else []
  (loss, correct, g_diff), g_h = jax.lax.scan(body, (zero, zero, g0), chunks)
  return loss, correct, g_diff, g_h


def _fused(logits_fn, join, diff, rest, h_chunks, t_chunks, m_chunks):
  """(loss_sum, correct_sum) with a VJP formed chunk by chunk in the forward pass."""
  diff_dtypes, h_dtype = [p.dtype for p in diff], h_chunks.dtype

  @jax.custom_vjp
  def fused(diff, h_chunks, rest, t_chunks, m_chunks):
    loss, correct, _, _ = _chunk_scan(logits_fn, join, False, diff, rest,
                                      (h_chunks, t_chunks, m_chunks))
    return loss, correct

  def fwd(diff, h_chunks, rest, t_chunks, m_chunks):
    loss, correct, g_diff, g_h = _chunk_scan(logits_fn, join, True, diff, rest,
                                             (h_chunks, t_chunks, m_chunks))
    return (loss, correct), (g_diff, g_h)

  def bwd(res, cotangents):
    g_diff, g_h = res
    ct = cotangents[0]  # the accuracy is a metric: no cotangent
    return ([(ct * g).astype(dt) for g, dt in zip(g_diff, diff_dtypes)],
            (ct * g_h).astype(h_dtype), None, None, None)

  fused.defvjp(fwd, bwd)
  loss, correct = fused(diff, h_chunks, rest, t_chunks, m_chunks)
  return loss, jax.lax.stop_gradient(correct)


def chunked_cross_entropy_sums(logits_fn, params, hidden_BxLxD, targets_BxL, mask_BxL, *,
                               chunk_len: int | None = None):
  """(loss_sum, correct_sum, tokens), the values of `cross_entropy_sums` on
  `logits_fn(params, hidden_BxLxD)`, holding only one chunk's logits at a time.

  logits_fn(params, h_BxCxD) -> fp32 logits (B, C, V); chunk_len None = auto_chunk_len."""
  B, L, _ = hidden_BxLxD.shape
  if chunk_len is None:
    vocab = jax.eval_shape(logits_fn, params, hidden_BxLxD[:, :1]).shape[-1]
    chunk_len = auto_chunk_len(B, L, vocab)
  n = math.ceil(L / max(1, min(int(chunk_len), L)))
  h_chunks = _to_chunks(hidden_BxLxD, n)
  t_chunks = _to_chunks(targets_BxL, n)
  m_chunks = _to_chunks(mask_BxL.astype(jnp.float32), n)  # padding: mask 0
  diff, rest, join = _split(params, h_chunks[0], logits_fn)
  loss, correct = _fused(logits_fn, join, diff, rest, h_chunks, t_chunks, m_chunks)
  return loss, correct, jnp.sum(mask_BxL.astype(jnp.float32))


def model_cross_entropy_sums(model: nnx.Module, hidden_BxLxD, targets_BxL, mask_BxL, *,
                             chunk_len: int | None = None):
  """`chunked_cross_entropy_sums` through a model's own `logits_from_hidden` (a Transformer,
  fake-quantized or adapted alike)."""
  graphdef, state = nnx.split(model)
  logits_fn = lambda state, h_BxCxD: nnx.merge(graphdef, state).logits_from_hidden(h_BxCxD)
  return chunked_cross_entropy_sums(logits_fn, state, hidden_BxLxD, targets_BxL, mask_BxL,
                                    chunk_len=chunk_len)
