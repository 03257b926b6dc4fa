"""The KV cache a decode extends: every attention layer's keys and values, stacked on a leading
layer axis, each slot's segment id, and a Gated DeltaNet layer's conv inputs and state."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from distillax.errors import UserError
from distillax.models.config import TransformerConfig
from distillax.partitioning import constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys/values of every attention layer (stacked on a leading layer axis) plus each slot's
  segment id; for Gated DeltaNet layers (Qwen3.5), their conv inputs and recurrent states.

  `end_index` is the next slot to write; slots past it are never attended (causality).
  A hybrid model's k/v stack holds its attention layers only, conv/state its linear layers
  (in layer order each); other models have no conv/state (None). Multi-head latent attention
  (DeepSeek, mla.py) caches what it compresses, not keys and values: k holds each token's
  normed latent (K = 1, H = kv_lora_rank), v its turned RoPE key (K = 1, H = qk_rope_head_dim).

  An int8 cache (dtype 'int8': scanned attention stacks only) holds each token's keys and values
  per kv head as int8 codes times one float32 scale (absmax / 127), in k_scale / v_scale laid
  out (N, B, 1, S*K): slot-major rows of heads, as the decode kernel reads its blocks. Half the
  bytes of a bf16 cache for every decode step to read; the values it returns are within half a
  code of each feature's (cache_slot.quantize_rows).
  """

  k_NxBxSxKxH: jax.Array
  v_NxBxSxKxH: jax.Array
  segment_ids_BxS: jax.Array
  end_index: jax.Array  # int32 scalar
  conv_NxBxPxC: jax.Array | None = None  # the last linear_conv_kernel - 1 conv inputs
  state_NxBxHxKxV: jax.Array | None = None  # float32 delta-rule state per value head
  k_scale_NxBx1xSK: jax.Array | None = None  # an int8 cache's key scales
  v_scale_NxBx1xSK: jax.Array | None = None  # ... and value scales
  # Known while tracing: nothing written yet (zeros() makes it, any call's update clears it),
  # so a prefill's queries attend only its own keys, by the fused kernel a training forward
  # uses, instead of every slot of the cache.
  empty: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @classmethod
  def zeros(cls, config: TransformerConfig, batch: int, length: int, dtype=None) -> "KVCache":
    dtype = jnp.dtype(dtype or config.dtype)
    if dtype == jnp.int8:
      return cls._int8_zeros(config, batch, length)
    if config.kv_lora_rank:  # the latent and the RoPE key of every layer
      lead = (config.num_layers, batch, length, 1)
      axes = ("layers", "batch", "length", None, None)
      return cls(constrain(jnp.zeros(lead + (config.kv_lora_rank,), dtype), axes),
                 constrain(jnp.zeros(lead + (config.qk_rope_head_dim,), dtype), axes),
                 jnp.zeros((batch, length), jnp.int32), jnp.zeros((), jnp.int32), empty=True)
    linear = config.num_linear_layers
    owners = [i for i in range(config.num_layers)
              if config.layer_owns_kv(i) and not config.layer_is_linear(i)]
    # Gemma 4's wider full layers: one width for all, each layer using its first heads and
    # features.
    head_dim = max([config.layer_head_dim(i) for i in owners] or [config.head_dim])
    kv_heads = max([config.layer_num_kv_heads(i) for i in owners] or [config.num_kv_heads])
    shape = (len(owners), batch, length, kv_heads, head_dim)
    k = constrain(jnp.zeros(shape, dtype), ("layers", "batch", "length", "kv_heads", "head_dim"))
    v = constrain(jnp.zeros(shape, dtype), ("layers", "batch", "length", "kv_heads", "head_dim"))
    conv = state = None
    if linear:
      Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
      channels = 2 * Hk * config.linear_key_head_dim + Hv * config.linear_value_head_dim
      conv = jnp.zeros((linear, batch, config.linear_conv_kernel - 1, channels), dtype)
      state = constrain(jnp.zeros((linear, batch, Hv, config.linear_key_head_dim,
                                   config.linear_value_head_dim), jnp.float32),
                        ("layers", "batch", "heads", None, None))
    return cls(k, v, jnp.zeros((batch, length), jnp.int32), jnp.zeros((), jnp.int32),
               conv, state, empty=True)

  @classmethod
  def _int8_zeros(cls, config: TransformerConfig, batch: int, length: int) -> "KVCache":
    if not config.scan_layers or config.kv_lora_rank or config.num_linear_layers:
      raise UserError("an int8 KV cache needs a scanned stack of attention layers "
                      "(model.scan_layers=True, no latent attention, no linear attention); "
                      "use the compute dtype's cache for this model")
    shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
    axes = ("layers", "batch", "length", "kv_heads", "head_dim")
    scales = (config.num_layers, batch, 1, length * config.num_kv_heads)
    return cls(constrain(jnp.zeros(shape, jnp.int8), axes),
               constrain(jnp.zeros(shape, jnp.int8), axes),
               jnp.zeros((batch, length), jnp.int32), jnp.zeros((), jnp.int32),
               k_scale_NxBx1xSK=jnp.zeros(scales, jnp.float32),
               v_scale_NxBx1xSK=jnp.zeros(scales, jnp.float32), empty=True)

  @property
  def length(self) -> int:
    return self.segment_ids_BxS.shape[1]

  def layer_caches(self, config: TransformerConfig):
    """What each layer reads: the stacked (k, v) for a scanned stack, else one entry per
    layer, (k, v) of an attention layer or (conv, state) of a Gated DeltaNet layer (None for a
    Gemma 4 layer that shares another's keys/values: it caches nothing)."""
    if config.scan_layers:
      if self.k_scale_NxBx1xSK is not None:
        return (self.k_NxBxSxKxH, self.v_NxBxSxKxH, self.k_scale_NxBx1xSK,
                self.v_scale_NxBx1xSK)
      return self.k_NxBxSxKxH, self.v_NxBxSxKxH
    counts, caches = [0, 0], []
    for i in range(config.num_layers):
      if not config.layer_owns_kv(i):
        caches.append(None)
        continue
      linear = config.layer_is_linear(i)
      j = counts[linear]
      counts[linear] += 1
      caches.append((self.conv_NxBxPxC[j], self.state_NxBxHxKxV[j]) if linear
                    else (self.k_NxBxSxKxH[j], self.v_NxBxSxKxH[j]))
    return caches

  def updated(self, config: TransformerConfig, layer_caches, segment_ids_BxS,
              end_index) -> "KVCache":
    """The cache after a call: `layer_caches` as `layer_caches` gives them, written back."""
    if config.scan_layers:
      scales = {} if len(layer_caches) == 2 else dict(k_scale_NxBx1xSK=layer_caches[2],
                                                       v_scale_NxBx1xSK=layer_caches[3])
      return dataclasses.replace(self, k_NxBxSxKxH=layer_caches[0], v_NxBxSxKxH=layer_caches[1],
                                 segment_ids_BxS=segment_ids_BxS, end_index=end_index,
                                 empty=False, **scales)
    kinds = [config.layer_is_linear(i) for i in range(config.num_layers)]
    kinds, layer_caches = zip(*[(kind, c) for kind, c in zip(kinds, layer_caches)
                                if c is not None])  # sharing layers cache nothing
    stack = lambda linear, part, old: (
        jnp.stack([c[part] for c, lin in zip(layer_caches, kinds) if lin == linear])
        if linear in kinds else old)
    return KVCache(stack(False, 0, self.k_NxBxSxKxH), stack(False, 1, self.v_NxBxSxKxH),
                   segment_ids_BxS, end_index, stack(True, 0, self.conv_NxBxPxC),
                   stack(True, 1, self.state_NxBxHxKxV))


def kv_cache_bytes_per_token(config: TransformerConfig, dtype=None) -> int:
  """Bytes a KVCache holds per cached token (every layer; the compute dtype unless `dtype`):
  full keys and values, or multi-head latent attention's latent and RoPE key. Read off the
  cache's own shapes, abstractly; a Gated DeltaNet layer's state is per sequence, not counted."""
  cache = jax.eval_shape(lambda: KVCache.zeros(config, 1, 1, dtype))
  parts = (cache.k_NxBxSxKxH, cache.v_NxBxSxKxH, cache.k_scale_NxBx1xSK, cache.v_scale_NxBx1xSK)
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in parts if x is not None)
