"""The Gated DeltaNet token mixer of Qwen3.5's linear-attention layers, as an NNX module that
stands where `Attention` stands in a block (same call, same (out, cache, probs) return).

x -> q, k, v projections -> causal depthwise conv + silu -> per-head L2 norm of q and k (q also
scaled by d_k^-0.5) -> the gated delta rule (decay g = -exp(A_log) softplus(x a + dt_bias), write
strength beta = sigmoid(x b)) -> RMSNorm per head times silu(x z) -> output projection. Value
heads outnumber key heads: value head h reads key head h // (Hv / Hk), as HF's checkpoints do.

Its cache entry is (conv inputs, recurrent state), not keys and values: decode costs the same at
every length. The segment ids of the tokens before a call (whose state it continues) are read
from the KV cache's per-slot segment ids, so packed or left-padded prompts reset correctly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.errors import ConfigError
from distillax.models import linear_attention as la
from distillax.models.config import TransformerConfig
from distillax.models.layers import next_params_key, normal_param
from distillax.partitioning import constrain


def previous_segments(k_segment_BxS, cache_index, count: int) -> jax.Array:
  """Segment ids of the `count` cache slots before `cache_index` (-1 before slot 0), (B, count)."""
  slots = cache_index - count + jnp.arange(count, dtype=jnp.int32)
  taken_BxN = jnp.take(k_segment_BxS, jnp.maximum(slots, 0), axis=1)
  return jnp.where(slots[None, :] >= 0, taken_BxN, -1)


class GatedDeltaNet(nnx.Module):
  """Linear attention with a gated delta-rule state per value head (Qwen3.5)."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    D, pd = config.embed_dim, config.jnp_param_dtype
    Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    heads = lambda n, d: normal_param(rngs, (D, n, d), D ** -0.5, pd,
                                      ("embed", "heads", "head_dim"))
    self.q, self.k, self.v, self.z = heads(Hk, dk), heads(Hk, dk), heads(Hv, dv), heads(Hv, dv)
    self.b = normal_param(rngs, (D, Hv), D ** -0.5, pd, ("embed", "heads"))  # write strength
    self.a = normal_param(rngs, (D, Hv), D ** -0.5, pd, ("embed", "heads"))  # decay step
    channels = 2 * Hk * dk + Hv * dv  # the conv runs over q, k and v features side by side
    kernel = config.linear_conv_kernel
    self.conv = normal_param(rngs, (kernel, channels), kernel ** -0.5, pd, (None, None))
    self.dt_bias = nnx.Param(jnp.ones((Hv,), pd), logical_axes=("heads",))
    # Decay rates A in [1, 16) as Qwen3.5 initialises them (kept in log space).
    rates = jax.random.uniform(next_params_key(rngs), (Hv,), jnp.float32, 1.0, 16.0)
    self.A_log = nnx.Param(jnp.log(rates).astype(pd), logical_axes=("heads",))
    self.norm_scale = nnx.Param(jnp.ones((dv,), pd), logical_axes=("head_dim",))
    out_std = (Hv * dv) ** -0.5 / math.sqrt(2 * config.num_layers)
    self.o = normal_param(rngs, (Hv, dv, D), out_std, pd, ("heads", "head_dim", "embed"))
    self.config = config

  def _delta_rule(self, q, k, v, g, beta, segment_ids_BxL, state, state_segment_B, cached: bool):
    cfg = self.config
    one_token = cached and q.shape[1] == 1
    if cfg.linear_attention_impl == "recurrent" or one_token:
      return la.gated_delta_rule_recurrent(q, k, v, g, beta, segment_ids_BxL=segment_ids_BxL,
                                           initial_state_BxHxKxV=state,
                                           state_segment_B=state_segment_B)
    return la.gated_delta_rule_chunked(q, k, v, g, beta, segment_ids_BxL=segment_ids_BxL,
                                       initial_state_BxHxKxV=state,
                                       state_segment_B=state_segment_B,
                                       chunk_size=cfg.linear_attention_chunk)

  def __call__(self, x_BxLxD, *, q_segment_BxL=None, k_segment_BxS=None, cache_kv=None,
               cache_index=None, **unused):
    """(out_BxLxD, new (conv, state) or None, None). Attention's other arguments (RoPE,
    indices, windows) mean nothing here and are ignored; probabilities there are none."""
    if unused.get("return_probs"):
      raise ConfigError("attention probabilities were asked of a model with Gated DeltaNet "
                        "layers (model.token_mixers), which form none; distil its attention "
                        "layers' features instead (e.g. feature projection), not attention maps")
    cfg = self.config
    dt = cfg.jnp_dtype
    B, L, _ = x_BxLxD.shape
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    project = lambda w: jnp.einsum("BLD,DNH->BLNH", x_BxLxD, w[...].astype(dt))
    qkv_BxLxC = jnp.concatenate([project(w).reshape(B, L, -1) for w in (self.q, self.k, self.v)],
                                axis=-1)
    conv_state = state = conv_segments = state_segment_B = None
    if cache_kv is not None:
      conv_state, state = cache_kv
      before_BxP = previous_segments(k_segment_BxS, cache_index, cfg.linear_conv_kernel)
      conv_segments, state_segment_B = before_BxP[:, 1:], before_BxP[:, -1]
    qkv_BxLxC, (new_conv, _) = la.causal_conv(
        qkv_BxLxC, self.conv[...], segment_ids_BxL=q_segment_BxL, state_BxPxC=conv_state,
        state_segments_BxP=conv_segments)
    qkv_BxLxC = jax.nn.silu(qkv_BxLxC)
    q, k, v = jnp.split(qkv_BxLxC, [Hk * dk, 2 * Hk * dk], axis=-1)
    q_BxLxHxK = jnp.repeat(la.l2_normalize(q.reshape(B, L, Hk, dk)) * dk ** -0.5, Hv // Hk, 2)
    k_BxLxHxK = jnp.repeat(la.l2_normalize(k.reshape(B, L, Hk, dk)), Hv // Hk, 2)
    v_BxLxHxV = v.reshape(B, L, Hv, dv)
    small = lambda w: jnp.einsum("BLD,DH->BLH", x_BxLxD, w[...].astype(dt)).astype(jnp.float32)
    beta_BxLxH = jax.nn.sigmoid(small(self.b))
    g_BxLxH = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
        small(self.a) + self.dt_bias[...].astype(jnp.float32))
    out_BxLxHxV, new_state = self._delta_rule(
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, g_BxLxH, beta_BxLxH, q_segment_BxL, state,
        state_segment_B, cached=cache_kv is not None)
    out_BxLxHxV = la.gated_rms_norm(out_BxLxHxV.astype(dt), project(self.z), self.norm_scale[...],
                                    cfg.norm_eps)
    out_BxLxHxV = constrain(out_BxLxHxV, ("batch", "length", "heads", "head_dim"))
    out_BxLxD = jnp.einsum("BLHV,HVD->BLD", out_BxLxHxV, self.o[...].astype(dt))
    new_cache = None if cache_kv is None else (new_conv.astype(conv_state.dtype), new_state)
    return constrain(out_BxLxD, ("batch", "residual_length", "embed")), new_cache, None
