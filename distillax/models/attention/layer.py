"""Grouped-query attention with causal + segment masks, sliding windows and a KV cache.

Optional per-architecture parts: q/k/v biases (Qwen 2; gpt-oss also biases o) and q/k RMSNorm
over head_dim (Qwen 3), both applied before RoPE, so the cache holds exactly the keys a full
forward computes. Attention sinks (gpt-oss): one learned logit per head joins every row's softmax
denominator (a key nobody sees whose value is zero), so a query may attend "nowhere".

Masks are built from token *indices* (order in the sequence or slot in the cache) and segment
ids: a query sees a key iff the key is not later, both carry the same segment id (packed
documents never see each other; padding, id 0, only sees padding) and, for local layers, the key
is less than `window` tokens back. Positions only feed RoPE, so they may restart per document.

How the scores meet the values is `model.attention_impl` (impl.py decides per call):
`reference_attention` here materialises them whole; the blockwise and fused paths never do.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.models import remat
from distillax.models.attention import impl as attention_impl
from distillax.models.config import TransformerConfig
from distillax.models.attention.blockwise import blockwise_attention
from distillax.models.attention.cache_slot import StackedSlot
from distillax.models.attention.decode import key_block, stacked_decode_attention
from distillax.models.attention.decode import per_device as decode_per_device
from distillax.models.attention.kv_cache import KVCache, kv_cache_bytes_per_token  # noqa: F401
from distillax.models.attention.fused import cudnn_attention, splash_attention
from distillax.models.attention.tokamax import tokamax_attention
from distillax.models.layers import RMSNorm, apply_rope, normal_param
from distillax.models.layers import softcap as _softcap
from distillax.partitioning import constrain

_MASKED = -1e30  # finite, so a fully masked row can never produce NaNs


def attention_mask(q_index_BxL, k_index_BxS, q_segment_BxL, k_segment_BxS) -> jax.Array:
  """Causal and segment mask, bool (B, L, S); no segment ids = one document."""
  causal = k_index_BxS[:, None, :] <= q_index_BxL[:, :, None]
  if q_segment_BxL is None:
    return causal
  same_segment = k_segment_BxS[:, None, :] == q_segment_BxL[:, :, None]
  return causal & same_segment


def window_mask(mask_BxLxS, q_index_BxL, k_index_BxS, window) -> jax.Array:
  """Restricts a mask to keys less than `window` tokens back (`window` may be traced)."""
  if window is None:
    return mask_BxLxS
  distance = q_index_BxL[:, :, None] - k_index_BxS[:, None, :]
  return mask_BxLxS & (distance < window)


def reference_attention(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, *, q_index_BxL, k_index_BxS,
                        q_segment_BxL=None, k_segment_BxS=None, window=None, scale: float,
                        softcap: float | None = None, sinks_KxG=None):
  """(out_BxLxKxGxH, probs_BxKxGxLxS): the whole fp32 scores and probabilities at once, the
  path every other implementation is checked against and the only one that returns probs
  (with sinks_KxG, their share of each row is left out: rows then sum to less than 1)."""
  logits_BxKxGxLxS = jnp.einsum("BLKGH,BSKH->BKGLS", q_BxLxKxGxH, k_BxSxKxH,
                                preferred_element_type=jnp.float32) * scale
  logits_BxKxGxLxS = _softcap(logits_BxKxGxLxS, softcap)
  mask = attention_mask(q_index_BxL, k_index_BxS, q_segment_BxL, k_segment_BxS)
  mask = window_mask(mask, q_index_BxL, k_index_BxS, window)
  logits_BxKxGxLxS = jnp.where(mask[:, None, None], logits_BxKxGxLxS, _MASKED)
  if sinks_KxG is None:
    probs_BxKxGxLxS = jax.nn.softmax(logits_BxKxGxLxS, axis=-1)
  else:
    sink_BxKxGxLx1 = jnp.broadcast_to(sinks_KxG.astype(jnp.float32)[None, :, :, None, None],
                                      logits_BxKxGxLxS.shape[:-1] + (1,))
    with_sink = jnp.concatenate([logits_BxKxGxLxS, sink_BxKxGxLx1], axis=-1)
    probs_BxKxGxLxS = jax.nn.softmax(with_sink, axis=-1)[..., :-1]
  out_BxLxKxGxH = jnp.einsum("BKGLS,BSKH->BLKGH", probs_BxKxGxLxS.astype(v_BxSxKxH.dtype),
                             v_BxSxKxH)
  return out_BxLxKxGxH, probs_BxKxGxLxS


def _qk_norm(config: TransformerConfig, heads: int, axis: str, Dh: int) -> RMSNorm | None:
  """Qwen 3's RMSNorm over each head's features, OLMo 2's over all `heads` heads at once."""
  if not config.qk_norm:
    return None
  if config.qk_norm_across_heads:
    return RMSNorm(config, dim=(heads, Dh), logical_axes=(axis, "head_dim"))
  return RMSNorm(config, dim=Dh, logical_axes=("head_dim",))


def _scale_free_norm(x_BxLxNxH, eps: float):
  """RMS norm over each head's features without a scale, in float32 (Gemma 4's value norm,
  Llama 4's q/k L2 norm)."""
  x = x_BxLxNxH.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
  return x.astype(x_BxLxNxH.dtype)


def _temperature_scaled(q_BxLxHxK, positions_BxL, config: TransformerConfig):
  """Llama 4's attention temperature: queries times log1p(floor((position + 1) / floor_scale))
  * scale + 1, so far positions sharpen the softmax of its RoPE-free layers."""
  floors = jnp.floor((positions_BxL.astype(jnp.float32) + 1.0)
                     / config.attn_temperature_floor_scale)
  scale_BxL = jnp.log1p(floors) * config.attn_temperature_scale + 1.0
  return (q_BxLxHxK.astype(jnp.float32) * scale_BxL[:, :, None, None]).astype(q_BxLxHxK.dtype)


def _rope_on_mxu(cfg: TransformerConfig) -> bool:
  """RoPE's halves swapped by a matmul (layers._rope_whole_heads) where the step compiles for a
  TPU, whose lanes the split halves fill by half; elsewhere the split form, fewer FLOPs. Not
  under full remat, which a job takes when memory is what it is short of: there the whole-head
  form's backward holds one more query-sized buffer at its peak (the real KD step at 4 x 2048,
  deviceless v5e compile: 64 MiB more, past what the chip takes), and the forward-only teacher
  of a KD step, whose remat is not 'full', keeps the faster form."""
  return attention_impl.compile_platform() == "tpu" and cfg.remat != "full"


def attend(cfg: TransformerConfig, q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, masking: dict, *,
           cached: bool, return_probs: bool, sinks_KxG=None):
  """(out, probs or None) by the implementation attention_impl.resolve picks for this call;
  `masking`: the indices, segment ids and window of `reference_attention`."""
  B, L, K, G, Dh = q_BxLxKxGxH.shape
  needs = attention_impl.AttentionNeeds(
      probs=return_probs, cached=cached, query_len=L, key_len=k_BxSxKxH.shape[1],
      segments=masking["q_segment_BxL"] is not None, window=cfg.sliding_window is not None,
      softcap=cfg.attn_logit_softcap is not None, dtype=cfg.dtype, head_dim=Dh,
      sinks=sinks_KxG is not None)
  impl = attention_impl.resolve(cfg.attention_impl, needs)
  common = dict(scale=cfg.attn_scale, softcap=cfg.attn_logit_softcap)
  if impl == "reference":
    return reference_attention(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, **masking, **common,
                               sinks_KxG=sinks_KxG)
  if impl == "blockwise":  # without a cache, indices are positions 0..L-1: skip the pairs
    return blockwise_attention(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, **masking, **common,
                               causal_offset=None if cached else 0, sinks_KxG=sinks_KxG), None
  fused = {"cudnn": cudnn_attention, "splash": splash_attention,
           "tokamax": tokamax_attention}[impl]
  windows = tuple(sorted(set(cfg.layer_windows() or (None,)), key=lambda w: w or 0))
  masking = {k: v for k, v in masking.items() if k not in ("q_index_BxL", "k_index_BxS")}
  if impl == "splash":
    common.update(blocks=cfg.splash_blocks, fused_bwd=cfg.splash_fused_bwd)
  return fused(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, **masking, windows=windows, **common), None


def attend_stacked(cfg: TransformerConfig, q_Bx1xKxGxH, slot: StackedSlot, masking: dict,
                   cache_index, *, sinks: bool):
  """One query per row attended by decode.py's kernel straight from the stacked cache `slot`
  (this call's keys already written), or None where attention_impl picks another path."""
  k_stack = slot.stacks[0]
  B, _, K, G, Dh = q_Bx1xKxGxH.shape
  S = k_stack.shape[2]
  needs = attention_impl.AttentionNeeds(
      cached=True, query_len=1, key_len=S, segments=masking["q_segment_BxL"] is not None,
      window=cfg.sliding_window is not None, softcap=cfg.attn_logit_softcap is not None,
      dtype=cfg.dtype, head_dim=Dh, sinks=sinks,
      stacked_cache=(k_stack.shape[3:] == (K, Dh)
                     and key_block(S, K * Dh * k_stack.dtype.itemsize) is not None))
  if attention_impl.resolve(cfg.attention_impl, needs) != "decode":
    return None
  mask_BxS = attention_mask(masking["q_index_BxL"], masking["k_index_BxS"],
                            masking["q_segment_BxL"], masking["k_segment_BxS"])
  mask_BxS = window_mask(mask_BxS, masking["q_index_BxL"], masking["k_index_BxS"],
                         masking["window"])[:, 0]
  k_stack, v_stack, *scales = slot.stacks
  out_BxKxGxH = decode_per_device(
      q_Bx1xKxGxH[:, 0], k_stack, v_stack, slot.layer, mask_BxS, cache_index + 1, *scales,
      kernel=stacked_decode_attention, scale=cfg.attn_scale, softcap=cfg.attn_logit_softcap)
  return None if out_BxKxGxH is None else out_BxKxGxH[:, None]


class Attention(nnx.Module):
  """Multi-head attention over `num_kv_heads` key/value heads shared by groups of query heads."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, owns_kv: bool = True,
               head_dim: int | None = None, num_kv_heads: int | None = None,
               keys_as_values: bool = False, l2_norm_qk: bool = False,
               temperature: bool = False):
    """owns_kv=False: a Gemma 4 layer that attends another layer's keys/values (no k, v);
    head_dim, num_kv_heads: this layer's, if not config's (Gemma 4's full layers);
    keys_as_values: its values are its keys before k_norm and RoPE (no v; Gemma 4 31B);
    l2_norm_qk: Llama 4's scale-free RMS norm of q and k heads after RoPE; temperature: Llama
    4's query scaling by position (model.attn_temperature_*)."""
    D, H = config.embed_dim, config.num_heads
    K = self.num_kv_heads = num_kv_heads or config.num_kv_heads
    Dh = self.head_dim = head_dim or config.head_dim
    pd = config.jnp_param_dtype
    self.q = normal_param(rngs, (D, H, Dh), D ** -0.5, pd, ("embed", "heads", "head_dim"))
    kv = lambda: (normal_param(rngs, (D, K, Dh), D ** -0.5, pd, ("embed", "kv_heads", "head_dim"))
                  if owns_kv else None)
    self.k, self.v = kv(), None if keys_as_values else kv()
    out_std = (H * Dh) ** -0.5 / math.sqrt(2 * config.num_layers)
    self.o = normal_param(rngs, (H, Dh, D), out_std, pd, ("heads", "head_dim", "embed"))
    # Qwen 2: biases on q, k, v (zero at init, so a fresh model starts as its bias-free twin);
    # Qwen 3: RMSNorm of every q and k head over its head_dim features.
    bias = lambda n, axis: (nnx.Param(jnp.zeros((n, Dh), pd), logical_axes=(axis, "head_dim"))
                            if config.qkv_bias else None)
    self.q_bias = bias(H, "heads")
    self.k_bias, self.v_bias = ((bias(K, "kv_heads"), bias(K, "kv_heads")) if owns_kv
                                else (None, None))
    # gpt-oss: a bias on o (zero at init) and one sink logit per query head.
    self.o_bias = (nnx.Param(jnp.zeros((D,), pd), logical_axes=("embed",))
                   if config.attn_out_bias else None)
    self.sinks = (nnx.Param(jnp.zeros((H,), pd), logical_axes=("heads",))
                  if config.attention_sinks else None)
    self.q_norm = _qk_norm(config, H, "heads", Dh)
    self.k_norm = _qk_norm(config, K, "kv_heads", Dh) if owns_kv else None
    # Gemma 4: values RMS-normed over head_dim without a scale (a function, no parameter).
    self.value_norm = config.value_norm
    self.l2_norm_qk, self.temperature = l2_norm_qk, temperature  # Llama 4
    # Qwen3.5: the attention output times sigmoid(x @ out_gate), per head and feature.
    self.out_gate = (normal_param(rngs, (D, H, Dh), D ** -0.5, pd, ("embed", "heads", "head_dim"))
                     if config.attn_output_gate else None)
    self.config = config

  def _project(self, x_BxLxD, weight, bias, norm):
    """x @ weight (+ bias) (then the per-head norm): (B, L, heads, head_dim), before RoPE."""
    dt = self.config.jnp_dtype
    y_BxLxNxH = jnp.einsum("BLD,DNH->BLNH", x_BxLxD, weight[...].astype(dt))
    if bias is not None:
      y_BxLxNxH = y_BxLxNxH + bias[...].astype(dt)
    if norm is not None:
      y_BxLxNxH = norm(y_BxLxNxH)
    return y_BxLxNxH

  def _own_keys_values(self, x_BxLxD, sin_cos):
    """This call's keys (normed, turned) and values (normed with value_norm; without a v
    projection, the keys before their norm and RoPE)."""
    k_BxLxKxH = self._project(x_BxLxD, self.k, self.k_bias, None)
    v_BxLxKxH = (k_BxLxKxH if self.v is None
                 else self._project(x_BxLxD, self.v, self.v_bias, None))
    if self.k_norm is not None:
      k_BxLxKxH = self.k_norm(k_BxLxKxH)
    if self.value_norm:
      v_BxLxKxH = _scale_free_norm(v_BxLxKxH, self.config.norm_eps)
    k_BxLxKxH = apply_rope(k_BxLxKxH, *sin_cos, swap_on_mxu=_rope_on_mxu(self.config))
    if self.l2_norm_qk:
      k_BxLxKxH = _scale_free_norm(k_BxLxKxH, self.config.norm_eps)
    k_BxLxKxH = constrain(k_BxLxKxH, ("batch", "length", "kv_heads", "head_dim"))
    return k_BxLxKxH, constrain(v_BxLxKxH, ("batch", "length", "kv_heads", "head_dim"))

  def _keys_values(self, k_BxLxKxH, v_BxLxKxH, cache_kv, cache_index):
    """(keys, values, new cache or None): this call's, or the cache with them written in."""
    if cache_kv is None:
      return k_BxLxKxH, v_BxLxKxH, None
    dt = self.config.jnp_dtype
    new_cache = self._written(k_BxLxKxH, v_BxLxKxH, cache_kv, cache_index)
    if isinstance(cache_kv, StackedSlot):  # a scan over the layers carries the whole stack
      k_cache, v_cache = new_cache.keys_values(dt)
    else:
      k_cache, v_cache = new_cache
    # A cache as wide as its widest layer (Gemma 4) holds ours first, heads and features.
    K, Dh = self.num_kv_heads, self.head_dim
    return k_cache[..., :K, :Dh].astype(dt), v_cache[..., :K, :Dh].astype(dt), new_cache

  @staticmethod
  def _written(k_BxLxKxH, v_BxLxKxH, cache_kv, cache_index):
    """The cache with this call's keys and values written at cache_index."""
    if isinstance(cache_kv, StackedSlot):
      return cache_kv.with_tokens(k_BxLxKxH, v_BxLxKxH, cache_index)
    k_cache, v_cache = cache_kv
    start = (0, cache_index, 0, 0)
    return (jax.lax.dynamic_update_slice(k_cache, k_BxLxKxH.astype(k_cache.dtype), start),
            jax.lax.dynamic_update_slice(v_cache, v_BxLxKxH.astype(v_cache.dtype), start))

  def _attend_own(self, q_BxLxKxGxH, k_BxLxKxH, v_BxLxKxH, masking: dict):
    """A prefill into an empty cache: its queries attend only this call's keys (the slots after
    them are empty, masked anyway), by whatever a training forward of these L tokens runs (a
    fused kernel), not a pass over every slot of the cache."""
    own = dict(masking, k_index_BxS=masking["q_index_BxL"],
               k_segment_BxS=masking["q_segment_BxL"])
    out, _ = self._attend(q_BxLxKxGxH, k_BxLxKxH, v_BxLxKxH, own, cached=False,
                          return_probs=False)
    return out

  def _attend(self, q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, masking: dict, *, cached: bool,
              return_probs: bool):
    sinks_KxG = None if self.sinks is None else self.sinks[...].reshape(
        q_BxLxKxGxH.shape[2], q_BxLxKxGxH.shape[3])
    q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH = remat.name_qkv(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH)
    return attend(self.config, q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, masking, cached=cached,
                  return_probs=return_probs, sinks_KxG=sinks_KxG)

  def __call__(self, x_BxLxD, *, sin_cos, q_index_BxL, k_index_BxS, q_segment_BxL=None,
               k_segment_BxS=None, window=None, cache_kv=None, cache_index=None,
               return_probs: bool = False, shared_kv=None, return_kv: bool = False,
               positions_BxL=None, fresh_cache: bool = False):
    """Returns (out_BxLxD, new (k, v) cache slices or None, probs_BxHxLxS or None), and with
    return_kv the (k_BxSxKxH, v_BxSxKxH) it attended (Gemma 4's later layers share them).

    Without a cache, keys are this call's tokens (S = L). With `cache_kv=(k_BxSxKxH, v_...)`,
    this call's keys/values are written at `cache_index` and the queries attend the whole cache.
    With `shared_kv` (another layer's return_kv), this layer computes no keys/values and
    attends those. Segment ids None: one document (no segment masking). fresh_cache: the cache
    held nothing before this call (_attend_own).
    """
    cfg = self.config
    dt = cfg.jnp_dtype
    B, L, _ = x_BxLxD.shape
    K, Dh = self.num_kv_heads, self.head_dim
    G = cfg.num_heads // K
    q_BxLxHxK = apply_rope(self._project(x_BxLxD, self.q, self.q_bias, self.q_norm), *sin_cos,
                           swap_on_mxu=_rope_on_mxu(self.config))
    if self.l2_norm_qk:
      q_BxLxHxK = _scale_free_norm(q_BxLxHxK, cfg.norm_eps)
    if self.temperature:  # Llama 4's RoPE-free layers
      q_BxLxHxK = _temperature_scaled(q_BxLxHxK, positions_BxL, cfg)
    q_BxLxHxK = constrain(q_BxLxHxK, ("batch", "length", "heads", "head_dim"))
    # Query head h = kv_head * G + g uses kv head h // G (the layout of HF checkpoints).
    q_BxLxKxGxH = q_BxLxHxK.reshape(B, L, K, G, Dh)
    masking = dict(q_index_BxL=q_index_BxL, k_index_BxS=k_index_BxS, q_segment_BxL=q_segment_BxL,
                   k_segment_BxS=k_segment_BxS, window=window)
    attn_BxLxKxGxH, probs_BxKxGxLxS, new_cache, kv = self._attention(
        x_BxLxD, q_BxLxKxGxH, sin_cos, masking, cache_kv, cache_index, shared_kv=shared_kv,
        fresh_cache=fresh_cache, return_probs=return_probs, return_kv=return_kv)
    attn_BxLxHxK = constrain(attn_BxLxKxGxH.astype(dt).reshape(B, L, K * G, Dh),
                             ("batch", "length", "heads", "head_dim"))
    if self.out_gate is not None:
      gate_BxLxHxK = self._project(x_BxLxD, self.out_gate, None, None)
      attn_BxLxHxK = attn_BxLxHxK * jax.nn.sigmoid(gate_BxLxHxK.astype(jnp.float32)).astype(dt)
    out_BxLxD = jnp.einsum("BLHK,HKD->BLD", attn_BxLxHxK, self.o[...].astype(dt))
    if self.o_bias is not None:
      out_BxLxD = out_BxLxD + self.o_bias[...].astype(dt)
    probs = None
    if return_probs:
      S = probs_BxKxGxLxS.shape[-1]
      probs = probs_BxKxGxLxS.reshape(B, K * G, L, S)
    out_BxLxD = constrain(out_BxLxD, ("batch", "residual_length", "embed"))
    if return_kv:
      return out_BxLxD, new_cache, probs, kv
    return out_BxLxD, new_cache, probs

  def _attention(self, x_BxLxD, q_BxLxKxGxH, sin_cos, masking: dict, cache_kv, cache_index, *,
                 shared_kv, fresh_cache: bool, return_probs: bool, return_kv: bool):
    """(attention out, probs or None, new cache or None, the (k, v) attended or None): by the
    decode kernel, over this call's own keys (an empty cache's prefill), or over what
    _keys_values gives (a cache, another layer's keys, or this call's)."""
    decoded, kv = None, None
    if shared_kv is not None:
      kv, new_cache = shared_kv, None
    else:
      own_kv = self._own_keys_values(x_BxLxD, sin_cos)
      plain = not return_probs and not return_kv
      if fresh_cache and cache_kv is not None and plain:
        new_cache = self._written(*own_kv, cache_kv, cache_index)
        decoded = self._attend_own(q_BxLxKxGxH, *own_kv, masking)
      elif isinstance(cache_kv, StackedSlot) and q_BxLxKxGxH.shape[1] == 1 and plain:
        new_cache = cache_kv.with_tokens(*own_kv, cache_index)
        decoded = attend_stacked(self.config, q_BxLxKxGxH, new_cache, masking, cache_index,
                                 sinks=self.sinks is not None)
      if decoded is None:
        *kv, new_cache = self._keys_values(*own_kv, cache_kv, cache_index)
    if decoded is not None:
      return decoded, None, new_cache, None
    out, probs = self._attend(q_BxLxKxGxH, *kv, masking, cached=cache_index is not None,
                              return_probs=return_probs)
    return out, probs, new_cache, tuple(kv)
