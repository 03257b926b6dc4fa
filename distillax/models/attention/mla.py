"""Multi-head latent attention (DeepSeek V2/V3, Kimi K2, Moonlight): every token's keys and
values are expanded from one compressed latent, so a KV cache holds the latent, not them.

Per token x (D features), with H heads, query/key head width Dqk = Dn + Dr (Dn features without
RoPE, then Dr with), value head width Dv, latent width R (`kv_lora_rank`):

  queries   q = x @ q                 (q_lora_rank = 0, DeepSeek V2-Lite / Moonlight-like)
              = norm(x @ q_a) @ q_b   (q_lora_rank > 0: a normed bottleneck, DeepSeek V3)
  latent    [c, k_rope] = x @ kv_a;  c = norm(c) (R features); k_rope (Dr): one RoPE key for
            every head
  expanded  [k_nope, v] = c @ kv_b per head (Dn + Dv); k = [k_nope, k_rope], q = [q_nope,
            turned q_rope]

Without a cache (training, scoring) the latent is expanded and attention runs over H key/value
heads as any multi-head attention does, through the same implementations (`layer.attend`); the
values are padded with zeros to Dqk when narrower (the fused kernels want one head width).
With a cache the cache holds c and the turned k_rope (`KVCache`: K = 1), and attention runs in
the latent ("absorbed"): each head's q_nope is taken into the latent by kv_b's key part,
scores are q_latent . c + q_rope . k_rope over one shared key head (R + Dr features), the heads
attend to c itself, and kv_b's value part takes each head's result back to Dv. The two orders
compute the same sums (the tests hold them to transformers' expanded form).

The latent norms use DeepSeek's own epsilon (1e-6, its RMSNorm class default). The softmax
scale is Dqk^-0.5 times DeepSeek's YaRN m(mscale_all_dim)^2 (`TransformerConfig.attn_scale`).
With `rope_interleaved` (DeepSeek's checkpoints) RoPE turns adjacent feature pairs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.models.attention.cache_slot import StackedSlot
from distillax.models.attention.layer import attend
from distillax.models.config import TransformerConfig
from distillax.models.layers import RMSNorm, apply_rope, normal_param
from distillax.partitioning import constrain

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which its latent norms keep


class LatentAttention(nnx.Module):
  """DeepSeek's multi-head latent attention; `__call__` as `Attention`'s."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    D, H, Dqk = config.embed_dim, config.num_heads, config.head_dim
    R, Rq, Dr, Dv = (config.kv_lora_rank, config.q_lora_rank, config.qk_rope_head_dim,
                     config.value_head_dim)
    pd = config.jnp_param_dtype
    heads = ("heads", "head_dim")
    # Queries: one projection, or DeepSeek V3's normed bottleneck q_a -> q_b.
    self.q = (None if Rq else normal_param(rngs, (D, H, Dqk), D ** -0.5, pd, ("embed",) + heads))
    self.q_a = normal_param(rngs, (D, Rq), D ** -0.5, pd, ("embed", "latent")) if Rq else None
    self.q_a_norm = (RMSNorm(config, dim=Rq, logical_axes=("latent",), eps=LATENT_NORM_EPS)
                     if Rq else None)
    self.q_b = (normal_param(rngs, (Rq, H, Dqk), Rq ** -0.5, pd, ("latent",) + heads) if Rq
                else None)
    self.kv_a = normal_param(rngs, (D, R + Dr), D ** -0.5, pd, ("embed", None))
    self.kv_a_norm = RMSNorm(config, dim=R, logical_axes=("latent",), eps=LATENT_NORM_EPS)
    self.kv_b = normal_param(rngs, (R, H, Dqk - Dr + Dv), R ** -0.5, pd, ("latent",) + heads)
    out_std = (H * Dv) ** -0.5 / math.sqrt(2 * config.num_layers)
    self.o = normal_param(rngs, (H, Dv, D), out_std, pd, heads + ("embed",))
    self.config = config

  def _weight(self, w):
    return w[...].astype(self.config.jnp_dtype)

  def _queries(self, x_BxLxD, sin_cos):
    """(q_nope (B, L, H, Dn), turned q_rope (B, L, H, Dr))."""
    if self.q is not None:
      q_BxLxHxK = jnp.einsum("BLD,DHK->BLHK", x_BxLxD, self._weight(self.q))
    else:
      c_BxLxR = self.q_a_norm(jnp.einsum("BLD,DR->BLR", x_BxLxD, self._weight(self.q_a)))
      q_BxLxHxK = jnp.einsum("BLR,RHK->BLHK", c_BxLxR, self._weight(self.q_b))
    nope = self.config.head_dim - self.config.qk_rope_head_dim
    q_rope = apply_rope(q_BxLxHxK[..., nope:], *sin_cos, self.config.rope_interleaved)
    return q_BxLxHxK[..., :nope], q_rope

  def _latent(self, x_BxLxD, sin_cos):
    """(normed latent c (B, L, 1, R), turned RoPE key (B, L, 1, Dr)): what the cache holds."""
    R = self.config.kv_lora_rank
    ckv_BxLxX = jnp.einsum("BLD,DX->BLX", x_BxLxD, self._weight(self.kv_a))
    c_BxLx1xR = self.kv_a_norm(ckv_BxLxX[..., :R])[:, :, None, :]
    k_rope = apply_rope(ckv_BxLxX[..., None, R:], *sin_cos, self.config.rope_interleaved)
    return c_BxLx1xR, k_rope

  def __call__(self, x_BxLxD, *, sin_cos, q_index_BxL, k_index_BxS, q_segment_BxL=None,
               k_segment_BxS=None, window=None, cache_kv=None, cache_index=None,
               return_probs: bool = False, positions_BxL=None):
    """(out_BxLxD, the cache's (latent, RoPE key) with this call's written in or None,
    probs_BxHxLxS or None); without a cache the keys are this call's tokens (S = L).
    positions_BxL: what Llama 4's temperature tuning reads in `Attention`; unused here."""
    del positions_BxL
    masking = dict(q_index_BxL=q_index_BxL, k_index_BxS=k_index_BxS,
                   q_segment_BxL=q_segment_BxL, k_segment_BxS=k_segment_BxS, window=window)
    q_nope, q_rope = self._queries(x_BxLxD, sin_cos)
    c_BxLx1xR, k_rope_BxLx1xP = self._latent(x_BxLxD, sin_cos)
    if cache_kv is None:
      attn_BxLxHxV, probs = self._expanded(q_nope, q_rope, c_BxLx1xR[:, :, 0],
                                           k_rope_BxLx1xP, masking, return_probs)
      new_cache = None
    elif isinstance(cache_kv, StackedSlot):  # a scan over the layers carries the whole stack
      new_cache = cache_kv.written((c_BxLx1xR, k_rope_BxLx1xP), cache_index)
      attn_BxLxHxV, probs = self._absorbed(q_nope, q_rope, *new_cache.layer_parts(), masking,
                                           return_probs)
    else:
      new_cache = tuple(jax.lax.dynamic_update_slice(cache, part.astype(cache.dtype),
                                                     (0, cache_index, 0, 0))
                        for cache, part in zip(cache_kv, (c_BxLx1xR, k_rope_BxLx1xP)))
      attn_BxLxHxV, probs = self._absorbed(q_nope, q_rope, *new_cache, masking, return_probs)
    attn_BxLxHxV = constrain(attn_BxLxHxV.astype(self.config.jnp_dtype),
                             ("batch", "length", "heads", "head_dim"))
    out_BxLxD = jnp.einsum("BLHV,HVD->BLD", attn_BxLxHxV, self._weight(self.o))
    return constrain(out_BxLxD, ("batch", "residual_length", "embed")), new_cache, probs

  def _expanded(self, q_nope, q_rope, c_BxSxR, k_rope_BxSx1xP, masking, return_probs):
    """Attention over H expanded key/value heads: (out (B, L, H, Dv), probs or None)."""
    cfg = self.config
    B, S, _ = c_BxSxR.shape
    H, Dn, Dv = cfg.num_heads, q_nope.shape[-1], cfg.value_head_dim
    kv_BxSxHxX = jnp.einsum("BSR,RHX->BSHX", c_BxSxR, self._weight(self.kv_b))
    k_rope = jnp.broadcast_to(k_rope_BxSx1xP, (B, S, H, k_rope_BxSx1xP.shape[-1]))
    k_BxSxHxK = jnp.concatenate([kv_BxSxHxX[..., :Dn], k_rope.astype(kv_BxSxHxX.dtype)], -1)
    q_BxLxHxK = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], -1)
    width = max(cfg.head_dim, Dv)  # one head width for every implementation
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
    q = constrain(pad(q_BxLxHxK), ("batch", "length", "heads", "head_dim"))
    k = constrain(pad(k_BxSxHxK), ("batch", "length", "heads", "head_dim"))
    v = constrain(pad(kv_BxSxHxX[..., Dn:]), ("batch", "length", "heads", "head_dim"))
    out_BxLxHx1xW, probs = attend(cfg, q[:, :, :, None, :], k, v, masking, cached=False,
                                  return_probs=return_probs)
    L = q.shape[1]
    probs = None if probs is None else probs.reshape(B, H, L, S)
    return out_BxLxHx1xW[:, :, :, 0, :Dv], probs

  def _absorbed(self, q_nope, q_rope, c_BxSx1xR, k_rope_BxSx1xP, masking, return_probs):
    """Attention in the latent against the cache: (out (B, L, H, Dv), probs or None)."""
    cfg = self.config
    dt = cfg.jnp_dtype
    Dn, R = q_nope.shape[-1], cfg.kv_lora_rank
    kv_b = self._weight(self.kv_b)
    q_latent_BxLxHxR = jnp.einsum("BLHN,RHN->BLHR", q_nope, kv_b[..., :Dn])
    q_BxLx1xHxX = jnp.concatenate([q_latent_BxLxHxR, q_rope.astype(dt)], -1)[:, :, None]
    c, k_rope = c_BxSx1xR.astype(dt), k_rope_BxSx1xP.astype(dt)
    k_BxSx1xX = jnp.concatenate([c, k_rope], -1)
    v_BxSx1xX = jnp.concatenate([c, jnp.zeros_like(k_rope)], -1)  # one width: c, then zeros
    out_BxLx1xHxX, probs = attend(cfg, q_BxLx1xHxX, k_BxSx1xX, v_BxSx1xX, masking, cached=True,
                                  return_probs=return_probs)
    out_BxLxHxR = out_BxLx1xHxX[:, :, 0, :, :R].astype(dt)
    attn_BxLxHxV = jnp.einsum("BLHR,RHV->BLHV", out_BxLxHxR, kv_b[..., Dn:])
    B, L = q_nope.shape[:2]
    probs = None if probs is None else probs.reshape(B, cfg.num_heads, L, -1)
    return attn_BxLxHxV, probs
