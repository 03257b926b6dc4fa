"""Packed dropout keep masks for the LoRA adapter path (`lora_matmul`).

A keep mask follows `jax.random.bernoulli`'s rule (23 uniform bits against float32(keep)) but
draws two elements per Threefry-2x32 block, the whole cost of dropout on CPU, and is packed to
one bit per element: that bit is all the adapter backward keeps of it.
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


def _random_words(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform uint32 words, one per element, from half as many Threefry-2x32 blocks.

  `jax.random.bits` runs one block per element and XORs its two output words into one; the
  Threefry blocks are the whole cost of dropout on CPU, so here each block's two words serve
  two neighbours along the last axis (counters as `jax.random.bits` lays them out over half
  the last axis, so it shards the same way). Falls back to `jax.random.bits` for other PRNG
  implementations, an odd last axis or more than 2**32 blocks.
  """
  data = jax.random.key_data(key)
  blocks = math.prod(shape) // 2
  if data.shape != (2,) or shape[-1] % 2 or blocks >= 2 ** 32:
    return jax.random.bits(key, shape, jnp.uint32)
  half = shape[:-1] + (shape[-1] // 2,)
  strides = np.cumprod((1,) + half[:0:-1])[::-1]
  counter = sum(jax.lax.broadcasted_iota(jnp.uint32, half, d) * np.uint32(st)
                for d, st in enumerate(strides))
  first, second = jax_random_ext.threefry2x32_p.bind(data[0], data[1],
                                                     jnp.zeros(half, jnp.uint32), counter)
  return jnp.stack([first, second], axis=-1).reshape(shape)


def keep_mask_bits(key: jax.Array, shape: tuple[int, ...], keep: float) -> jax.Array:
  """Dropout's keep mask: element kept with probability `keep`, by the rule of
  `jax.random.bernoulli` (23 uniform bits against float32(keep)), each element from its own
  Threefry output word. Packed eight to a uint8 along the last axis (bool where that axis is
  not a multiple of 8): 1 bit per input element is what the backward keeps of the mask."""
  keep_BxD = (_random_words(key, shape) >> 9) < jnp.uint32(_keep_threshold(keep))
  if shape[-1] % 8:
    return keep_BxD
  lanes = keep_BxD.reshape(shape[:-1] + (shape[-1] // 8, 8)).astype(jnp.uint8)
  return jnp.sum(lanes << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def unpack_keep_mask(bits: jax.Array, last_dim: int) -> jax.Array:
  """The bool mask of `keep_mask_bits`."""
  if bits.dtype == jnp.bool_:
    return bits
  lanes = (bits[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
  return lanes.reshape(bits.shape[:-1] + (last_dim,)).astype(jnp.bool_)

