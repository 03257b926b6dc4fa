"""One layer's place in a stacked KV cache, for a scan over the layers.

A scan that took each layer's cache as input (`xs`) and returned the updated one as output
(`ys`) would read the whole cache and write a whole new stack at every call: at decode, one
token per row, that copy is most of what a step reads and writes (the real 0.6B student's 16
rows of 1,024 slots: 1.9 GB of keys and values against 1.2 GB of weights). With a slot the scan
carries the stack instead: a call writes only its own tokens into it, in place, at
(layer, :, index), and reads its layer back for the attention.

An int8 cache (kv_cache.KVCache) carries four stacks: the keys' and values' int8 codes and
their scales, one per token and kv head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def quantize_rows(x_BxLxKxH: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(int8 codes, float32 scales (B, L, K)): each token's head features over absmax / 127,
  rounded to the nearest code; a zero row keeps scale 0."""
  x = x_BxLxKxH.astype(jnp.float32)
  scale_BxLxK = jnp.max(jnp.abs(x), axis=-1) / 127.0
  safe = jnp.where(scale_BxLxK > 0, scale_BxLxK, 1.0)
  codes = jnp.clip(jnp.round(x / safe[..., None]), -127, 127).astype(jnp.int8)
  return codes, scale_BxLxK


def dequantize_rows(codes_BxSxKxH: jax.Array, scale_BxSxK: jax.Array, dtype) -> jax.Array:
  return (codes_BxSxKxH.astype(jnp.float32) * scale_BxSxK[..., None]).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedSlot:
  """`stacks`: the cache's parts, each (N layers, B, S, ...), or for an int8 cache
  (k codes, v codes, k scales, v scales), the scales (N, B, 1, S*K); `layer`: this layer's
  index in them (an int32 scalar, traced under scan)."""

  stacks: tuple[jax.Array, ...]
  layer: jax.Array

  @property
  def quantized(self) -> bool:
    return len(self.stacks) == 4

  def _write(self, stack, part, start_rest):
    start = (self.layer,) + tuple(start_rest) + (0,) * (stack.ndim - 1 - len(start_rest))
    return jax.lax.dynamic_update_slice(stack, part.astype(stack.dtype)[None], start)

  def written(self, parts_BxLx: tuple[jax.Array, ...], cache_index) -> "StackedSlot":
    """The slot with `parts_BxLx` (one per stack, this call's L tokens) written at slot
    `cache_index` of this layer."""
    return StackedSlot(tuple(self._write(s, p, (0, cache_index))
                             for s, p in zip(self.stacks, parts_BxLx)), self.layer)

  def with_tokens(self, k_BxLxKxH, v_BxLxKxH, cache_index) -> "StackedSlot":
    """The slot with this call's keys and values written at `cache_index` (as int8 codes and
    scales in an int8 cache)."""
    if not self.quantized:
      return self.written((k_BxLxKxH, v_BxLxKxH), cache_index)
    B, L, K, _ = k_BxLxKxH.shape
    (k_codes, k_scale), (v_codes, v_scale) = map(quantize_rows, (k_BxLxKxH, v_BxLxKxH))
    k_stack, v_stack, ks_stack, vs_stack = self.stacks
    rows = lambda scale_BxLxK: scale_BxLxK.reshape(B, 1, L * K)
    return StackedSlot((self._write(k_stack, k_codes, (0, cache_index)),
                        self._write(v_stack, v_codes, (0, cache_index)),
                        self._write(ks_stack, rows(k_scale), (0, 0, cache_index * K)),
                        self._write(vs_stack, rows(v_scale), (0, 0, cache_index * K))),
                       self.layer)

  def layer_parts(self) -> tuple[jax.Array, ...]:
    """This layer's part of every stack, (B, S, ...) each."""
    return tuple(jax.lax.dynamic_index_in_dim(s, self.layer, 0, keepdims=False)
                 for s in self.stacks)

  def keys_values(self, dtype) -> tuple[jax.Array, jax.Array]:
    """This layer's keys and values (B, S, K, H), dequantized to `dtype` from an int8 cache."""
    parts = self.layer_parts()
    if not self.quantized:
      return parts[0], parts[1]
    k_codes, v_codes, k_scale, v_scale = parts
    B, S, K, _ = k_codes.shape
    per_head = lambda scale_Bx1xSK: scale_Bx1xSK.reshape(B, S, K)
    return (dequantize_rows(k_codes, per_head(k_scale), dtype),
            dequantize_rows(v_codes, per_head(v_scale), dtype))
