"""One decoded token per row against a stacked KV cache: a Pallas TPU kernel that reads the
layer's keys and values straight out of the stack, and only the blocks that hold tokens.

Why: a decode step reads every weight once for all rows, and each row's cache. The reference
path attends a layer's cache sliced out of the stack (attention/cache_slot.py): on a v5e the
compiler copies that slice before the dot, so each cached key and value was read, written and
read again, and every slot of the cache was read whether filled or not. The real 0.6B student
decoding 32 rows of 536 to 768 slots took 2.8x its roofline per cached slot (benchmarks/results/
tpu/sampler_decode_call3.json). Here the kernel's BlockSpecs index the stack at the layer (a
scalar prefetched into SMEM), so the DMA reads the cache once; blocks past the last filled
slot map to the last filled block, which Pallas does not fetch again, and are skipped.

The cache is read as rows of (slot, kv head), H features each: the stack's own bytes (its
(K, H) tiles), so no copy makes them. One matmul of a row's K*G queries against a block's rows
scores every query against every head; each query keeps its own head's columns (the rest are
masked out of the softmax, so the values' matmul takes only its own head). A decode matmul is
bound by streaming the cache through the MXU, not by its FLOPs, so the K-fold products cost
nothing that matters.

Masking is what reference_attention's is (causal, segments, window), computed outside as one
(B, S) bool: the kernel sees which slots a row may attend. At 48 rows of the real student's
int8 cache on a v5e the kernel takes 1.01-1.04x the time of its block fetches alone
(benchmarks/results/tpu/decode_kernel_call16.json): the next group of rows' first block is
fetched under the current group's last compute (_block_index), and masks are biases added to
the scores (_attend_row); before both it took 1.2x as long at 640 and 768 filled slots
(decode_kernel_call15.json). Soft-capped logits are supported;
attention sinks are not (the caller falls back to the reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from distillax.partitioning import active_rules

_MASKED = -1e30
_BLOCKS = (1024, 512, 256, 128)  # slots per key block, the largest that divides the cache
# Bytes of one key block: keys and values, each double-buffered, stay within the 16 MiB of
# VMEM a kernel gets by default (a float32 cache of 1,024-slot blocks at 8 x 128 needs 16.05).
_BLOCK_BYTES = 2 * 2 ** 20


def key_block(length: int, row_bytes: int = 0) -> int | None:
  """Slots per key block for a cache of `length` slots of `row_bytes` each (every kv head's
  features), or None where no block fits (then the caller attends by the reference path)."""
  fits = [b for b in _BLOCKS if b * row_bytes <= _BLOCK_BYTES] or [_BLOCKS[-1]]
  for block in fits:
    if length % block == 0:
      return block
  return length if length <= fits[0] and length % 8 == 0 else None


def layout(rows: int, length: int, row_bytes: int) -> tuple[int, int]:
  """(slots per key block, rows per grid step): the most rows a step (8 at most) whose blocks
  still fit the bytes, each block as large as they allow. Measured on the v5e at the real
  student's shape (32 rows of 1,024 slots, 768 filled; benchmarks/results/tpu/
  decode_kernel_call13.json): 8 rows of 128-slot blocks took 0.84x the time of one row of
  1,024-slot blocks in bf16, 8 rows of 256 slots 0.94x in int8. Small blocks let the kernel
  skip the unfilled tail of the cache; several rows a step pay the grid's per-step cost once."""
  for per_step in (8, 4, 2):
    if rows % per_step == 0:
      block = key_block(length, per_step * row_bytes)
      if block is not None and block * per_step * row_bytes <= _BLOCK_BYTES:
        return block, per_step
  return key_block(length, row_bytes), 1


def resolve_layout(rows: int, length: int, row_bytes: int, block: int | None = None,
                   rows_per_step: int | None = None) -> tuple[int | None, int]:
  """(block, rows per step) a call runs: layout()'s choice, or the given ones (a given row
  count takes the largest block that fits it)."""
  if rows_per_step is None:
    chosen_block, rows_per_step = layout(rows, length, row_bytes)
  else:
    chosen_block = key_block(length, rows_per_step * row_bytes)
  return block or chosen_block, rows_per_step


def _kernel(sref, q_ref, k_ref, v_ref, valid_ref, head_bias_ref, *rest, scale: float,
            softcap: float | None, R: int, quantized: bool):
  rest = list(rest)
  scale_refs = (rest.pop(0), rest.pop(0)) if quantized else None  # int8 codes' (slot, head)
  o_ref, m_ref, l_ref, acc_ref = rest
  s = pl.program_id(1)

  @pl.when(s == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(s < sref[1])
  def _block():
    for r in range(R):  # the grid step's rows, one after another
      _attend_row(r, q_ref, k_ref, v_ref, valid_ref, head_bias_ref, m_ref, l_ref, acc_ref,
                  scale_refs, scale=scale, softcap=softcap)

  @pl.when(s == pl.num_programs(1) - 1)
  def _out():
    o_ref[...] = (acc_ref[...] / jnp.maximum(l_ref[...], 1e-30)).astype(o_ref.dtype)


def _attend_row(r, q_ref, k_ref, v_ref, valid_ref, head_bias_ref, m_ref, l_ref, acc_ref,
                scale_refs, *, scale, softcap):
  """One row's online-softmax update over the block. Column j of the block is slot j // K, kv
  head j % K: query row i (head i // G) keeps its own head's columns of the slots it may
  attend. The masks are -inf biases added to the scores (the other heads' columns, one constant
  block read once a call; the row's unattended slots), so the exponential is 0 there without a
  select; an int8 block's key scales and the softmax scale are one product. The running max
  starts finite (-1e30), so a query none of whose slots were valid yet gets exp(-inf) = 0,
  never exp(0). Compares and selects instead took 1.03x the time at 48 int8 rows on the v5e
  (benchmarks/results/tpu/decode_kernel_call15.json, `prefetch` against the default)."""
  q = q_ref[r]
  k = k_ref[0, r].astype(q.dtype) if scale_refs else k_ref[0, r]
  scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)  # (K*G, blk*K)
  scores = scores * (scale_refs[0][0, r] * scale if scale_refs else scale)
  if softcap is not None:
    scores = softcap * jnp.tanh(scores / softcap)
  scores = scores + head_bias_ref[...] + valid_ref[r]
  m_prev = m_ref[r]
  m_new = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
  p = jnp.exp(scores - m_new)
  alpha = jnp.exp(m_prev - m_new)
  l_ref[r] = alpha * l_ref[r] + p.sum(axis=1, keepdims=True)
  v = v_ref[0, r].astype(q.dtype) if scale_refs else v_ref[0, r]
  weights = p * scale_refs[1][0, r] if scale_refs else p
  acc_ref[r] = alpha * acc_ref[r] + jnp.dot(weights.astype(v.dtype), v,
                                            preferred_element_type=jnp.float32)
  m_ref[r] = m_new


def _vmem_limit(cache_bytes: int) -> int | None:
  """A VMEM limit above the default (16 MiB) only where the key and value blocks, each double
  buffered, need it (blocks over layout()'s 2 MiB, given by the caller): theirs and 16 MiB for
  the queries, masks, scales, scores and scratch (less failed to compile on the v5e)."""
  return None if cache_bytes <= 4 * _BLOCK_BYTES else cache_bytes + 16 * 2 ** 20


def _block_index(b, s, sref, row_groups: int, prefetch_next_rows: bool):
  """(row group, key block) a grid step (b, s) reads. Steps past the row group's last filled
  block compute nothing; they name the block read last, which is not fetched again, or (with
  prefetch_next_rows) the next row group's first block, so its fetch overlaps the compute of
  this group's last block instead of standing alone at the group's start."""
  last = jnp.minimum(s, sref[1] - 1)
  if not prefetch_next_rows:
    return b, last
  ahead = (s >= sref[1]) & (b + 1 < row_groups)
  return jnp.where(ahead, b + 1, b), jnp.where(ahead, 0, last)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "interpret", "block",
                                             "rows_per_step", "prefetch_next_rows"))
def stacked_decode_attention(q_BxKxGxH, k_NxBxSxKxH, v_NxBxSxKxH, layer, valid_BxS, filled,
                             k_scale_NxBx1xSK=None, v_scale_NxBx1xSK=None, *, scale: float,
                             softcap: float | None = None, interpret: bool = False,
                             block: int | None = None, rows_per_step: int | None = None,
                             prefetch_next_rows: bool = True) -> jax.Array:
  """(B, K, G, H) attention outputs (float32) of one query position per row against layer
  `layer` of the stacks. valid_BxS: which slots each row attends; filled: how many slots from
  the start may be valid (the blocks past it are neither read nor computed). An int8 cache
  passes its codes as the stacks and its scales (kv_cache.KVCache); the queries then run in
  their own dtype against the codes, each row's product times its scale. `block` and
  `rows_per_step` override layout()'s choice (resolve_layout); `prefetch_next_rows` off gives
  the kernel's earlier schedule (_block_index), which benchmarks/decode_kernel.py measures."""
  N, B, S, K, H = k_NxBxSxKxH.shape
  block, R = resolve_layout(B, S, K * H * k_NxBxSxKxH.dtype.itemsize, block, rows_per_step)
  if B % R:
    raise ValueError(f"rows_per_step={R} must divide the {B} rows")
  if block is None or S % block:
    raise ValueError(f"no key block divides a cache of {S} slots")
  return _pallas_decode(q_BxKxGxH, k_NxBxSxKxH, v_NxBxSxKxH, layer, valid_BxS, filled,
                        k_scale_NxBx1xSK, v_scale_NxBx1xSK, block=block, R=R, scale=scale,
                        softcap=softcap, interpret=interpret,
                        prefetch_next_rows=prefetch_next_rows)


def _pallas_decode(q_BxKxGxH, k_NxBxSxKxH, v_NxBxSxKxH, layer, valid_BxS, filled,
                   k_scale_NxBx1xSK, v_scale_NxBx1xSK, *, block: int, R: int, scale: float,
                   softcap: float | None, interpret: bool,
                   prefetch_next_rows: bool) -> jax.Array:
  """The kernel's call at one layout (block slots, R rows a grid step)."""
  N, B, S, K, H = k_NxBxSxKxH.shape
  G = q_BxKxGxH.shape[2]
  blocks_needed = jnp.clip((filled + block - 1) // block, 1, S // block)
  sref = jnp.stack([jnp.asarray(layer, jnp.int32), blocks_needed.astype(jnp.int32)])
  # (slot, head) rows: the stack's own bytes (its (K, H) tiles), so the reshape is free.
  k_rows = k_NxBxSxKxH.reshape(N, B, S * K, H)
  v_rows = v_NxBxSxKxH.reshape(N, B, S * K, H)
  rows = block * K
  # 0 where attended, -inf elsewhere: added to the scores (_attend_row).
  valid_Bx1xSK = jnp.where(jnp.repeat(valid_BxS, K, axis=1), 0.0, -jnp.inf)[:, None, :]
  own_head = (jnp.arange(K * G)[:, None] // G) == (jnp.arange(rows)[None, :] % K)
  head_bias = jnp.where(own_head, 0.0, -jnp.inf).astype(jnp.float32)
  quantized = k_scale_NxBx1xSK is not None
  q_dtype = q_BxKxGxH.dtype if quantized else k_NxBxSxKxH.dtype
  q_BxKGxH = q_BxKxGxH.astype(q_dtype).reshape(B, K * G, H)
  cache_spec, scale_spec, valid_spec = _stream_specs(R, rows, H, B // R, prefetch_next_rows)
  scales = (k_scale_NxBx1xSK, v_scale_NxBx1xSK) if quantized else ()
  out = pl.pallas_call(
      functools.partial(_kernel, scale=scale, softcap=softcap, R=R, quantized=quantized),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(B // R, S // block),
          in_specs=[pl.BlockSpec((R, K * G, H), lambda b, s, sref: (b, 0, 0)),
                    cache_spec, cache_spec,
                    valid_spec,
                    pl.BlockSpec((K * G, rows), lambda b, s, sref: (0, 0)),
                    *[scale_spec] * len(scales)],
          out_specs=pl.BlockSpec((R, K * G, H), lambda b, s, sref: (b, 0, 0)),
          scratch_shapes=[pltpu.VMEM((R, K * G, 1), jnp.float32),
                          pltpu.VMEM((R, K * G, 1), jnp.float32),
                          pltpu.VMEM((R, K * G, H), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((B, K * G, H), jnp.float32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary"),
          vmem_limit_bytes=_vmem_limit(4 * R * rows * H * k_rows.dtype.itemsize)),
      interpret=interpret,
  )(sref, q_BxKGxH, k_rows, v_rows, valid_Bx1xSK, head_bias, *scales)
  return out.reshape(B, K, G, H)


def _stream_specs(R: int, rows: int, H: int, row_groups: int, prefetch_next_rows: bool):
  """The BlockSpecs of what streams through the grid, each step's block per _block_index: the
  cache's (slot, head) rows, an int8 cache's scales, and the valid mask."""
  index = functools.partial(_block_index, row_groups=row_groups,
                            prefetch_next_rows=prefetch_next_rows)
  def cache_map(b, s, sref):
    b, s = index(b, s, sref)
    return sref[0], b, s, 0
  def scale_map(b, s, sref):
    b, s = index(b, s, sref)
    return sref[0], b, 0, s
  def valid_map(b, s, sref):
    b, s = index(b, s, sref)
    return b, 0, s
  return (pl.BlockSpec((1, R, rows, H), cache_map), pl.BlockSpec((1, R, 1, rows), scale_map),
          pl.BlockSpec((R, 1, rows), valid_map))


def per_device(q_BxKxGxH, k_NxBxSxKxH, v_NxBxSxKxH, layer, valid_BxS, filled, *scales,
               kernel=stacked_decode_attention, **kwargs) -> jax.Array | None:
  """`kernel` (stacked_decode_attention) on each device's rows and kv heads: under rules over a
  mesh of several devices, inside a shard_map (the compiler cannot partition a Pallas call);
  None where the rules split what a device's kernel needs whole (the layers, the slots, the
  features; or, with an int8 cache's scales, the kv heads), so the caller attends otherwise."""
  active = active_rules()
  if active is None or active.mesh.size == 1:
    return kernel(q_BxKxGxH, k_NxBxSxKxH, v_NxBxSxKxH, layer, valid_BxS, filled, *scales,
                  **kwargs)
  def spec(logical, x):
    resolved = tuple(active.rules.resolve(logical, x.shape, active.mesh, "the decode kernel"))
    return resolved + (None,) * (x.ndim - len(resolved))
  q_spec = spec(("batch", "kv_heads", None, None), q_BxKxGxH)
  kv_spec = spec(("layers", "batch", "length", "kv_heads", "head_dim"), k_NxBxSxKxH)
  layers, rows, slots, heads, features = kv_spec
  if layers or slots or features or q_spec[:2] != (rows, heads) or (scales and heads):
    return None
  P = jax.sharding.PartitionSpec
  local = lambda *args: kernel(*args, **kwargs)
  return jax.shard_map(
      local, mesh=active.mesh, check_vma=False, out_specs=P(*q_spec),
      in_specs=(P(*q_spec), P(*kv_spec), P(*kv_spec), P(), P(rows, None), P(),
                *[P(None, rows, None, None)] * len(scales)),
  )(q_BxKxGxH, k_NxBxSxKxH, v_NxBxSxKxH, layer, valid_BxS, filled, *scales)
