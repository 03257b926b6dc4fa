"""Blockwise attention: an online softmax over (query block, key block) pairs, with a custom VJP
that recomputes each pair's scores in the backward pass.

Memory is one pair's (block_q x block_k) scores per head plus O(L) per-row state (running max and
sum, the fp32 output accumulator, the log-sum-exp kept for the backward pass): the (L, S) scores
of the reference path never exist, so long contexts fit. It is plain JAX (a scan, einsums,
dynamic slices), so it runs under jit, shard_map, pmap and vmap(axis_name) on every platform.

Masking matches the reference path exactly: a query sees a key iff the key's index is not later,
both carry the same segment id and (local layers) the key is less than `window` indices back.
When the caller knows the indices are plain positions (`causal_offset`: query i is index
offset + i, key j is index j, as in any forward without a KV cache), the pairs no query can see
(above the causal diagonal, or beyond a static window) are left out of the schedule at trace
time: causal attention does about half the work. The schedule is static: no data-dependent
branch (a `lax.cond` here would make JAX keep every block's scores when a scan over layers is
differentiated, and its predicate would need a collective across a sharded batch).

Attention sinks (gpt-oss) start every row's running max at its head's sink logit and its running
sum at 1 (exp(sink - sink)): the sink joins the denominator as a key with a zero value. Its
gradient needs no pass over the pairs: d sink = -sum over rows of exp(sink - lse) * (dout . out).

Padding added to make L and S multiples of the block sizes gets segment ids no real token has,
so it is never seen and never sees. Statistics and accumulators are fp32; the probabilities meet
the values in the compute dtype, as in the reference path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from distillax.models import remat
from distillax.models.config import GLOBAL_WINDOW

BLOCK_Q = 512  # queries per block
BLOCK_K = 512  # keys per block
_MASKED = -1e30  # finite, as in the reference path
_PAD_Q, _PAD_K = -(2**31), -(2**31) + 1  # segment ids of padding rows/columns: never equal


def _acc(x) -> jnp.dtype:
  """Accumulation dtype: fp32, or the inputs' own when wider (float64 checks)."""
  return jnp.promote_types(x.dtype, jnp.float32)


def _blocks(x, block: int, fill):
  """(B, N, ...) -> (N // block, B, block, ...), padding N up to a multiple of `block`."""
  pad = -x.shape[1] % block
  if pad:
    widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, widths, constant_values=fill)
  n = x.shape[1] // block
  x = x.reshape(x.shape[0], n, block, *x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _unblock(x, length: int):
  """(N, B, block, ...) -> (B, length, ...) (drops the padding)."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def pair_schedule(nq: int, nk: int, bq: int, bk: int, causal_offset: int | None,
                  window: int | None) -> tuple[np.ndarray, np.ndarray]:
  """(query block, key block) pairs to visit. With causal_offset, pairs where no query can see
  any key (every key later than every query, or every key `window` or more indices back) are
  left out; without, every pair is visited and the mask alone decides."""
  i, j = np.meshgrid(np.arange(nq), np.arange(nk), indexing="ij")
  keep = np.ones_like(i, bool)
  if causal_offset is not None:
    q_first, q_last = i * bq + causal_offset, (i + 1) * bq - 1 + causal_offset
    k_first, k_last = j * bk, (j + 1) * bk - 1
    keep &= k_first <= q_last
    if window is not None:
      keep &= q_first - k_last < window
  return i[keep].astype(np.int32), j[keep].astype(np.int32)


def _visible(qi_BxQ, qs_BxQ, ki_BxT, ks_BxT, window):
  """(B, 1, 1, Q, T) bool: which keys each query sees."""
  causal = ki_BxT[:, None, :] <= qi_BxQ[:, :, None]
  near = qi_BxQ[:, :, None] - ki_BxT[:, None, :] < window
  same = ks_BxT[:, None, :] == qs_BxQ[:, :, None]
  return (causal & near & same)[:, None, None]


def _scores(q_BxQxKxGxH, k_BxTxKxH, scale, softcap):
  """Soft-capped scaled scores, fp32 (B, K, G, Q, T)."""
  s = jnp.einsum("BQKGH,BTKH->BKGQT", q_BxQxKxGxH, k_BxTxKxH,
                 preferred_element_type=_acc(q_BxQxKxGxH)) * scale
  return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _at(blocks, index):
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), blocks)


def _add_at(acc, index, value):
  """acc[index] += value along the leading (block) axis."""
  current = jax.lax.dynamic_index_in_dim(acc, index, keepdims=False)
  return jax.lax.dynamic_update_index_in_dim(acc, current + value, index, 0)


def _prepare(q, k, v, qi, ki, qs, ks, static):
  """The operands in blocks. The barrier ties the masks' inputs (indices, segment ids: the same
  for every layer) to the queries: otherwise a scan over layers hoists the mask of every pair
  out of its loop when it is differentiated, and holds all of them at once."""
  bq, bk = static[2], static[3]
  q, k, v, qi, ki, qs, ks = jax.lax.optimization_barrier((q, k, v, qi, ki, qs, ks))
  q_blocks = (_blocks(q, bq, 0), _blocks(qi, bq, 0), _blocks(qs, bq, _PAD_Q))
  kv_blocks = (_blocks(k, bk, 0), _blocks(v, bk, 0), _blocks(ki, bk, 0), _blocks(ks, bk, _PAD_K))
  return q_blocks, kv_blocks


def _schedule(q_blocks, kv_blocks, static):
  nq, nk = q_blocks[0].shape[0], kv_blocks[0].shape[0]
  return tuple(jnp.asarray(a) for a in pair_schedule(nq, nk, *static[2:]))


def _forward(q, k, v, qi, ki, qs, ks, window, sinks, static):
  """(out (B, L, K, G, H), lse (Nq, B, K, G, bq)): the online softmax over the scheduled pairs."""
  scale, softcap = static[0], static[1]
  q_blocks, kv_blocks = _prepare(q, k, v, qi, ki, qs, ks, static)
  nq, B, bq, K, G, H = q_blocks[0].shape
  acc_dt = _acc(q)
  rows = (nq, B, K, G, bq)
  if sinks is None:
    m0, l0 = jnp.full(rows, _MASKED, acc_dt), jnp.zeros(rows, acc_dt)
  else:
    m0, l0 = jnp.broadcast_to(sinks.astype(acc_dt)[:, :, None], rows), jnp.ones(rows, acc_dt)
  init = (m0, l0, jnp.zeros((nq, B, K, G, bq, H), acc_dt))

  def step(carry, pair):
    i, j = pair
    m_all, l_all, acc_all = carry
    qb, qib, qsb = _at(q_blocks, i)
    kb, vb, kib, ksb = _at(kv_blocks, j)
    mask = _visible(qib, qsb, kib, ksb, window)
    s = jnp.where(mask, _scores(qb, kb, scale, softcap), _MASKED)
    m, l, acc = _at((m_all, l_all, acc_all), i)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("BKGQT,BTKH->BKGQH", p.astype(vb.dtype), vb, preferred_element_type=acc_dt)
    write = lambda all_, x: jax.lax.dynamic_update_index_in_dim(all_, x, i, 0)
    return (write(m_all, m_new), write(l_all, l * corr + p.sum(-1)),
            write(acc_all, acc * corr[..., None] + pv)), None

  (m, l, acc), _ = jax.lax.scan(step, init, _schedule(q_blocks, kv_blocks, static))
  seen = l > 0
  out = acc / jnp.where(seen, l, 1.0)[..., None]
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
  out = jnp.einsum("NBKGQH->NBQKGH", out).astype(q.dtype)
  return _unblock(out, q.shape[1]), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attention(q, k, v, qi, ki, qs, ks, window, sinks, static):
  return _forward(q, k, v, qi, ki, qs, ks, window, sinks, static)[0]


def _attention_fwd(q, k, v, qi, ki, qs, ks, window, sinks, static):
  out, lse_blocks = remat.name_attention_out(*_forward(q, k, v, qi, ki, qs, ks, window, sinks,
                                                        static))
  return out, (q, k, v, qi, ki, qs, ks, window, sinks, out, lse_blocks)


def _pair_grads(q_side, kv_side, window, static):
  """(dq, dk, dv) in fp32 of one (query block, key block) pair, recomputing its probabilities
  from the saved log-sum-exp."""
  scale, softcap = static[0], static[1]
  q, qi, qs, do, lse, delta = q_side
  k, v, ki, ks = kv_side
  mask = _visible(qi, qs, ki, ks, window)
  capped = _scores(q, k, scale, softcap)
  p = jnp.where(mask, jnp.exp(capped - lse[..., None]), 0.0)
  acc_dt = _acc(q)
  dv = jnp.einsum("BKGQT,BQKGH->BTKH", p.astype(do.dtype), do, preferred_element_type=acc_dt)
  dp = jnp.einsum("BQKGH,BTKH->BKGQT", do, v, preferred_element_type=acc_dt)
  ds = p * (dp - delta[..., None])
  if softcap is not None:
    ds = ds * (1.0 - jnp.square(capped / softcap))
  ds = (ds * scale).astype(q.dtype)
  dq = jnp.einsum("BKGQT,BTKH->BQKGH", ds, k, preferred_element_type=acc_dt)
  dk = jnp.einsum("BKGQT,BQKGH->BTKH", ds, q, preferred_element_type=acc_dt)
  return dq, dk, dv


def _attention_bwd(static, res, dout):
  q, k, v, qi, ki, qs, ks, window, sinks, out, lse_blocks = res
  bq = static[2]
  acc_dt = _acc(q)
  delta = jnp.einsum("BLKGH,BLKGH->BKGL", dout.astype(acc_dt), out.astype(acc_dt))
  q_blocks, kv_blocks = _prepare(q, k, v, qi, ki, qs, ks, static)
  delta_blocks = _delta_blocks(delta, bq)
  q_side = (*q_blocks, _blocks(dout.astype(q.dtype), bq, 0), lse_blocks, delta_blocks)
  dsinks = None
  if sinks is not None:  # the sink's probability per row times that row's dout . out
    p_sink = jnp.exp(sinks.astype(acc_dt)[:, :, None] - lse_blocks)
    dsinks = -jnp.einsum("NBKGQ,NBKGQ->KG", p_sink, delta_blocks).astype(sinks.dtype)

  def step(carry, pair):
    i, j = pair
    dq_all, dk_all, dv_all = carry
    dq, dk, dv = _pair_grads(_at(q_side, i), _at(kv_blocks, j), window, static)
    return (_add_at(dq_all, i, dq), _add_at(dk_all, j, dk), _add_at(dv_all, j, dv)), None

  zeros = lambda x: jnp.zeros(x.shape, acc_dt)
  init = (zeros(q_blocks[0]), zeros(kv_blocks[0]), zeros(kv_blocks[1]))
  (dq, dk, dv), _ = jax.lax.scan(step, init, _schedule(q_blocks, kv_blocks, static))
  S = k.shape[1]
  return (_unblock(dq, q.shape[1]).astype(q.dtype), _unblock(dk, S).astype(k.dtype),
          _unblock(dv, S).astype(v.dtype), None, None, None, None, None, dsinks)


def _delta_blocks(delta_BxKxGxL, block: int):
  """(B, K, G, L) -> (Nq, B, K, G, bq), the layout of the blocked log-sum-exp."""
  blocked = _blocks(jnp.moveaxis(delta_BxKxGxL, -1, 1), block, 0)  # (Nq, B, bq, K, G)
  return jnp.moveaxis(blocked, 2, -1)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, *, q_index_BxL, k_index_BxS,
                        q_segment_BxL=None, k_segment_BxS=None, window=None, scale: float,
                        softcap: float | None = None, causal_offset: int | None = None,
                        block_q: int | None = None, block_k: int | None = None, sinks_KxG=None):
  """Attention output (B, L, K, G, H) in the queries' dtype, never forming (L, S) scores.

  window: None (global) or keys less than this many indices back (may be traced, as under
  scanned layers). Segment ids default to one document. causal_offset: the caller's promise
  that q_index = causal_offset + arange(L) and k_index = arange(S) in every row (a forward
  without a KV cache: 0), so invisible block pairs are skipped; None visits every pair.
  sinks_KxG: one sink logit per query head (gpt-oss), or None."""
  B, L = q_index_BxL.shape
  S = k_index_BxS.shape[1]
  if q_segment_BxL is None:
    q_segment_BxL = jnp.ones((B, L), jnp.int32)
    k_segment_BxS = jnp.ones((B, S), jnp.int32)
  static_window = window if isinstance(window, int) else None
  window = jnp.asarray(GLOBAL_WINDOW if window is None else window, jnp.int32)
  bq, bk = min(block_q or BLOCK_Q, L), min(block_k or BLOCK_K, S)
  static = (float(scale), None if softcap is None else float(softcap), bq, bk, causal_offset,
            static_window)
  return _attention(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, q_index_BxL.astype(jnp.int32),
                    k_index_BxS.astype(jnp.int32), q_segment_BxL.astype(jnp.int32),
                    k_segment_BxS.astype(jnp.int32), window, sinks_KxG, static)
