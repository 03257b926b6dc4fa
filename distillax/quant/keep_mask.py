"""Packed dropout keep masks for the LoRA adapter path (`lora_matmul`).

A keep mask follows `jax.random.bernoulli`'s rule (23 uniform bits against float32(keep)) but
draws two elements per Threefry-2x32 block, the whole cost of dropout on CPU, and is packed to
one bit per element (eight rows to a byte where it can: a TPU's tile): that bit is all the
adapter backward keeps of it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import random as jax_random_ext


def _keep_threshold(keep: float) -> int:
  """`jax.random.bernoulli(key, keep)` keeps where `uniform(key) < float32(keep)`, and that
  uniform is exactly `(bits >> 9) * 2**-23` of a uniform 32-bit word: so it keeps where
  `bits >> 9` is below this integer."""
  return math.ceil(float(np.float32(keep)) * 2.0 ** 23)


def _half_strides(shape: tuple[int, ...]) -> np.ndarray:
  """Row-major strides of the blocks, laid out as `jax.random.bits` lays counters over half the
  last axis (so they shard the same way): element (..., d) is in block (..., d // 2)."""
  half = shape[:-1] + (shape[-1] // 2,)
  return np.cumprod((1,) + half[:0:-1])[::-1]


def _words_by_pairs(data: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Half as many Threefry blocks as elements, each block's two words to two neighbours along
  the last axis: on a CPU the blocks are the whole cost of dropout."""
  half = shape[:-1] + (shape[-1] // 2,)
  counter = sum(jax.lax.broadcasted_iota(jnp.uint32, half, a) * np.uint32(st)
                for a, st in enumerate(_half_strides(shape)))
  first, second = jax_random_ext.threefry2x32_p.bind(data[0], data[1],
                                                     jnp.zeros(half, jnp.uint32), counter)
  return jnp.stack([first, second], axis=-1).reshape(shape)


def _words_by_element(data: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The same words, each element running its own block and keeping its word of it: twice the
  Threefry work, but no interleave along the last axis. Why: on a TPU that interleave (a minor
  axis of 2) was most of what the QLoRA step's recomputed dropout cost, 355 of 4,113 ms in the
  call-22 profile, while the Threefry rounds are cheap vector work."""
  last = len(shape) - 1
  column = jax.lax.broadcasted_iota(jnp.uint32, shape, last)
  counter = column // np.uint32(2) + sum(
      jax.lax.broadcasted_iota(jnp.uint32, shape, a) * np.uint32(st)
      for a, st in enumerate(_half_strides(shape)[:-1]))
  first, second = jax_random_ext.threefry2x32_p.bind(data[0], data[1],
                                                     jnp.zeros(shape, jnp.uint32), counter)
  return jnp.where(column % np.uint32(2) == 1, second, first)


def _random_words(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform uint32 words, one per element, neighbours along the last axis sharing one
  Threefry-2x32 block's two words (`jax.random.bits` runs one block per element and XORs its
  two words into one). Built by pairs on a CPU, by element elsewhere: the same words
  (`lax.platform_dependent` picks at lowering). Falls back to `jax.random.bits` for other
  PRNG implementations, an odd last axis or more than 2**32 blocks."""
  data = jax.random.key_data(key)
  blocks = math.prod(shape) // 2
  if data.shape != (2,) or shape[-1] % 2 or blocks >= 2 ** 32:
    return jax.random.bits(key, shape, jnp.uint32)
  return jax.lax.platform_dependent(data, cpu=lambda d: _words_by_pairs(d, shape),
                                    default=lambda d: _words_by_element(d, shape))


def packs_rows(shape: tuple[int, ...]) -> bool:
  """Whether a keep mask of `shape` packs eight rows (the second-to-last axis) to a byte, not
  eight neighbours along the last axis. Why rows: a TPU holds an array in tiles of 8 rows by 128
  lanes, so eight rows reduce within a tile, where eight lanes are a minor axis of 8 padded to
  128."""
  return len(shape) >= 2 and shape[-2] % 8 == 0


def keep_mask_bits(key: jax.Array, shape: tuple[int, ...], keep: float) -> jax.Array:
  """Dropout's keep mask: element kept with probability `keep`, by the rule of
  `jax.random.bernoulli` (23 uniform bits against float32(keep)), each element from its own
  Threefry output word. Packed eight to a uint8 along the second-to-last axis where it is a
  multiple of 8 (`packs_rows`), else along the last where that is, else left bool: 1 bit per
  input element is what the backward keeps of the mask."""
  keep_BxD = (_random_words(key, shape) >> 9) < jnp.uint32(_keep_threshold(keep))
  weights = jnp.arange(8, dtype=jnp.uint8)
  if packs_rows(shape):
    rows = keep_BxD.reshape(shape[:-2] + (shape[-2] // 8, 8, shape[-1])).astype(jnp.uint8)
    return jnp.sum(rows << weights[:, None], axis=-2, dtype=jnp.uint8)
  if shape[-1] % 8:
    return keep_BxD
  lanes = keep_BxD.reshape(shape[:-1] + (shape[-1] // 8, 8)).astype(jnp.uint8)
  return jnp.sum(lanes << weights, axis=-1, dtype=jnp.uint8)


def unpack_keep_mask(bits: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The bool mask of `keep_mask_bits` for an input of `shape`."""
  if bits.dtype == jnp.bool_:
    return bits
  weights = jnp.arange(8, dtype=jnp.uint8)
  if packs_rows(shape):
    rows = (bits[..., None, :] >> weights[:, None]) & 1
    return rows.reshape(shape).astype(jnp.bool_)
  lanes = (bits[..., None] >> weights) & 1
  return lanes.reshape(shape).astype(jnp.bool_)
