"""Blockwise attention: an online softmax over key blocks, query block by query block, with a
custom VJP that recomputes each block's scores in the backward pass.

Memory is O(block_q x block_k) scores per head at a time plus O(L) per-row statistics (the
running max and sum, and the log-sum-exp kept for the backward pass): the (L, S) scores of the
reference path never exist, so long contexts fit. It is plain JAX (scans, a cond, einsums), so
it runs under jit, shard_map, pmap and vmap(axis_name) on every platform.

Masking matches the reference path exactly: a query sees a key iff the key's index is not later,
both carry the same segment id and (local layers) the key is less than `window` indices back.
Blocks where no query sees any key are skipped (`lax.cond`). Padding added to make L and S
multiples of the block sizes gets segment ids no real token has, so it is never seen and never
sees. Softmax statistics and accumulators are fp32; the probabilities meet the values in the
compute dtype, as in the reference path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from distillax.models.config import GLOBAL_WINDOW

BLOCK_Q = 512  # queries per block
BLOCK_K = 512  # keys per block
_MASKED = -1e30  # finite, as in the reference path
_PAD_Q, _PAD_K = -(2**31), -(2**31) + 1  # segment ids of padding rows/columns: never equal


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


def _scan(step, init, xs):
  """lax.scan, or one direct call when there is one block (tiny shapes compile simpler)."""
  if jax.tree.leaves(xs)[0].shape[0] > 1:
    return jax.lax.scan(step, init, xs)
  carry, y = step(init, jax.tree.map(lambda x: x[0], xs))
  return carry, jax.tree.map(lambda x: x[None], y)


def _skip_unseen(mask, blocks: int, compute, skip, carry):
  """compute(carry) where some query sees some key of the block, skip(carry) elsewhere; with a
  single block there is nothing to skip."""
  if blocks == 1:
    return compute(carry)
  return jax.lax.cond(jnp.any(mask), compute, skip, carry)


def _visible(qi_BxQ, qs_BxQ, ki_BxT, ks_BxT, window):
  """(B, 1, 1, Q, T) bool: which keys each query sees."""
  causal = ki_BxT[:, None, :] <= qi_BxQ[:, :, None]
  near = qi_BxQ[:, :, None] - ki_BxT[:, None, :] < window
  same = ks_BxT[:, None, :] == qs_BxQ[:, :, None]
  return (causal & near & same)[:, None, None]


def _scores(q_BxQxKxGxH, k_BxTxKxH, scale, softcap):
  """(raw scaled scores, soft-capped scores), fp32 (B, K, G, Q, T)."""
  s = jnp.einsum("BQKGH,BTKH->BKGQT", q_BxQxKxGxH, k_BxTxKxH,
                 preferred_element_type=jnp.float32) * scale
  return s, (s if softcap is None else softcap * jnp.tanh(s / softcap))


def _forward_q_block(q_blk, kv_blocks, window, static):
  """Online softmax of one query block over every key block: (out, lse)."""
  q, qi, qs = q_blk
  scale, softcap = static[0], static[1]
  B, Q, K, G, H = q.shape
  init = (jnp.full((B, K, G, Q), _MASKED, jnp.float32), jnp.zeros((B, K, G, Q), jnp.float32),
          jnp.zeros((B, K, G, Q, H), jnp.float32))

  def step(carry, kv):
    k, v, ki, ks = kv
    mask = _visible(qi, qs, ki, ks, window)

    def update(carry):
      m, l, acc = carry
      _, s = _scores(q, k, scale, softcap)
      s = jnp.where(mask, s, _MASKED)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      pv = jnp.einsum("BKGQT,BTKH->BKGQH", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32)
      return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    return _skip_unseen(mask, kv_blocks[0].shape[0], update, lambda c: c, carry), None

  (m, l, acc), _ = _scan(step, init, kv_blocks)
  seen = l > 0
  out = acc / jnp.where(seen, l, 1.0)[..., None]
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
  return jnp.einsum("BKGQH->BQKGH", out).astype(q.dtype), lse


def _prepare(q, k, v, qi, ki, qs, ks, static):
  bq, bk = static[2], static[3]
  q_blocks = (_blocks(q, bq, 0), _blocks(qi, bq, 0), _blocks(qs, bq, _PAD_Q))
  kv_blocks = (_blocks(k, bk, 0), _blocks(v, bk, 0), _blocks(ki, bk, 0), _blocks(ks, bk, _PAD_K))
  return q_blocks, kv_blocks


def _forward(q, k, v, qi, ki, qs, ks, window, static):
  q_blocks, kv_blocks = _prepare(q, k, v, qi, ki, qs, ks, static)
  fn = lambda _, blk: (None, _forward_q_block(blk, kv_blocks, window, static))
  _, (out_blocks, lse_blocks) = _scan(fn, None, q_blocks)
  return _unblock(out_blocks, q.shape[1]), lse_blocks  # lse kept blocked: (Nq, B, K, G, bq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attention(q, k, v, qi, ki, qs, ks, window, static):
  return _forward(q, k, v, qi, ki, qs, ks, window, static)[0]


def _attention_fwd(q, k, v, qi, ki, qs, ks, window, static):
  out, lse_blocks = _forward(q, k, v, qi, ki, qs, ks, window, static)
  return out, (q, k, v, qi, ki, qs, ks, window, out, lse_blocks)


def _backward_kv_block(kv, q_side, window, static):
  """Gradients from one key block: (dk, dv) of the block and dq contributions of every query
  block (Nq, B, bq, K, G, H), recomputing the probabilities from the saved log-sum-exp."""
  k, v, ki, ks = kv
  scale, softcap = static[0], static[1]
  B, T, K, H = k.shape

  def step(carry, blk):
    q, qi, qs, do, lse, delta = blk
    mask = _visible(qi, qs, ki, ks, window)

    def grads(carry):
      dk, dv = carry
      _, capped = _scores(q, k, scale, softcap)
      p = jnp.where(mask, jnp.exp(capped - lse[..., None]), 0.0)
      dv = dv + jnp.einsum("BKGQT,BQKGH->BTKH", p.astype(do.dtype), do,
                           preferred_element_type=jnp.float32)
      dp = jnp.einsum("BQKGH,BTKH->BKGQT", do, v, preferred_element_type=jnp.float32)
      ds = p * (dp - delta[..., None])
      if softcap is not None:
        ds = ds * (1.0 - jnp.square(capped / softcap))
      ds = (ds * scale).astype(q.dtype)
      dq = jnp.einsum("BKGQT,BTKH->BQKGH", ds, k, preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("BKGQT,BQKGH->BTKH", ds, q, preferred_element_type=jnp.float32)
      return (dk, dv), dq

    skip = lambda c: (c, jnp.zeros(q.shape, jnp.float32))
    return _skip_unseen(mask, q_side[0].shape[0], grads, skip, carry)

  zeros = jnp.zeros((B, T, K, H), jnp.float32)
  (dk, dv), dq_blocks = _scan(step, (zeros, zeros), q_side)
  return dk, dv, dq_blocks


def _attention_bwd(static, res, dout):
  q, k, v, qi, ki, qs, ks, window, out, lse_blocks = res
  delta = jnp.einsum("BLKGH,BLKGH->BKGL", dout.astype(jnp.float32), out.astype(jnp.float32))
  q_blocks, kv_blocks = _prepare(q, k, v, qi, ki, qs, ks, static)
  bq = static[2]
  q_side = (*q_blocks, _blocks(dout.astype(q.dtype), bq, 0), lse_blocks,
            _delta_blocks(delta, bq))

  def outer(dq_acc, kv):
    dk, dv, dq_blocks = _backward_kv_block(kv, q_side, window, static)
    return dq_acc + dq_blocks, (dk, dv)

  dq_blocks, (dk_blocks, dv_blocks) = _scan(
      outer, jnp.zeros(q_blocks[0].shape, jnp.float32), kv_blocks)
  S = k.shape[1]
  dq = _unblock(dq_blocks, q.shape[1]).astype(q.dtype)
  dk = _unblock(dk_blocks, S).astype(k.dtype)
  dv = _unblock(dv_blocks, S).astype(v.dtype)
  return dq, dk, dv, None, None, None, None, None


def _delta_blocks(delta_BxKxGxL, block: int):
  """(B, K, G, L) -> (Nq, B, K, G, bq), the layout of the blocked log-sum-exp."""
  blocked = _blocks(jnp.moveaxis(delta_BxKxGxL, -1, 1), block, 0)  # (Nq, B, bq, K, G)
  return jnp.moveaxis(blocked, 2, -1)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, *, q_index_BxL, k_index_BxS,
                        q_segment_BxL=None, k_segment_BxS=None, window=None, scale: float,
                        softcap: float | None = None, block_q: int | None = None,
                        block_k: int | None = None):
  """Attention output (B, L, K, G, H) in the queries' dtype, never forming (L, S) scores.

  window: None (global) or keys less than this many indices back (may be traced, as under
  scanned layers). Segment ids default to one document."""
  B, L = q_index_BxL.shape
  S = k_index_BxS.shape[1]
  if q_segment_BxL is None:
    q_segment_BxL = jnp.ones((B, L), jnp.int32)
    k_segment_BxS = jnp.ones((B, S), jnp.int32)
  window = jnp.asarray(GLOBAL_WINDOW if window is None else window, jnp.int32)
  bq, bk = min(block_q or BLOCK_Q, L), min(block_k or BLOCK_K, S)
  static = (float(scale), None if softcap is None else float(softcap), bq, bk)
  return _attention(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, q_index_BxL.astype(jnp.int32),
                    k_index_BxS.astype(jnp.int32), q_segment_BxL.astype(jnp.int32),
                    k_segment_BxS.astype(jnp.int32), window, static)
