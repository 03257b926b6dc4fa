"""The decoder LM: embedding, N pre-norm blocks (unrolled or stacked+scanned), final norm, logits.

`model(tokens_BxL, ...)` returns a `ModelOutput`; what distillation needs beyond the logits
(per-layer hidden states, per-layer attention probabilities) is only computed when asked for,
since the flags are Python values fixed at trace time. `logits_from_hidden` lets a loss turn the
final hidden states into logits chunk by chunk without ever holding (B, L, V) at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.errors import ConfigError
from distillax.models import layer_scope, remat
from distillax.models.attention.cache_slot import StackedSlot
from distillax.models.attention.chunked import chunk_segments
from distillax.models.attention.layer import Attention, KVCache
from distillax.models.attention.mla import LatentAttention
from distillax.models.config import TransformerConfig
from distillax.models.gated_deltanet import GatedDeltaNet
from distillax.models.layers import (MLP, Embedder, RMSNorm, normal_param, rope_sin_cos,
                                     rope_tables, softcap)
from distillax.models.moe.layer import MoE, RouterStats
from distillax.models.moe.gemma4 import Gemma4MoE
from distillax.models.per_layer_inputs import PerLayerGate, PerLayerInputs
from distillax.partitioning import constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelOutput:
  """What a forward pass returns. Optional fields are None unless requested.

  hidden_states: (num_layers + 1, B, L, D): index 0 is the embedding output, index i the output
    of block i (the residual stream before the final norm).
  attention_probs: (num_layers, B, num_heads, L, S) float32 softmax probabilities.
  cache: the updated KVCache when one was passed in.
  router_stats: a mixture of experts' routing per layer (moe.RouterStats, leading axis: the
    layers with experts, in order; None for a dense model). Unused, it costs nothing: XLA
    drops it.
  router_logits_NxBxLxE: (MoE layers, B, L, E) float32 router logits of a mixture of experts,
    when requested; computed from each router's input behind stop_gradient (moe.MoE), so a
    loss on them trains the routers only.
  """

  logits_BxLxV: jax.Array | None
  final_hidden_BxLxD: jax.Array
  hidden_states: jax.Array | None = None
  attention_probs: jax.Array | None = None
  cache: KVCache | None = None
  router_stats: RouterStats | None = None
  router_logits_NxBxLxE: jax.Array | None = None


class Block(nnx.Module):
  """Pre-norm attention + gated MLP (or mixture of experts), each added to the residual (Gemma 2
  also post-norms, OLMo only post-norms; Gemma 4 then gates in the layer's own input and scales
  the output)."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, layer: int = 0):
    self.attn_norm = RMSNorm(config) if config.pre_norms else None  # OLMo: post norms only
    if config.layer_is_linear(layer):  # Qwen3.5's hybrid
      self.attn = GatedDeltaNet(config, rngs=rngs)
    elif config.kv_lora_rank:  # DeepSeek's multi-head latent attention
      self.attn = LatentAttention(config, rngs=rngs)
    else:
      rope = config.layer_has_rope(layer)  # Llama 4: L2 norms with RoPE, temperature without
      self.attn = Attention(config, rngs=rngs, owns_kv=config.layer_owns_kv(layer),
                            head_dim=config.layer_head_dim(layer),
                            num_kv_heads=config.layer_num_kv_heads(layer),
                            keys_as_values=config.layer_keys_are_values(layer),
                            l2_norm_qk=config.qk_l2_norm and rope,
                            temperature=config.attn_temperature_floor_scale is not None
                            and not rope)
    self.chunked = config.layer_is_chunked(layer)  # Llama 4's RoPE layers
    self.mlp_norm = RMSNorm(config) if config.pre_norms else None
    moe = config.layer_is_moe(layer)  # the others (moe_layers) run a dense MLP
    if moe and config.moe_dense_mlp:  # Gemma 4 26B: a dense MLP beside the experts
      self.mlp = Gemma4MoE(config, rngs=rngs, dense_dim=config.layer_mlp_dim(layer))
    else:
      self.mlp = (MoE(config, rngs=rngs) if moe
                  else MLP(config, rngs=rngs, dim=config.layer_mlp_dim(layer)))
    self.post_attn_norm = RMSNorm(config) if config.use_post_norms else None
    self.post_mlp_norm = RMSNorm(config) if config.use_post_norms else None
    self.per_layer = (PerLayerGate(config, rngs=rngs) if config.per_layer_input_dim else None)
    self.scalar = (nnx.Param(jnp.ones((1,), config.jnp_param_dtype), logical_axes=(None,))
                   if config.layer_scalar else None)
    # Gemma 4: whether later layers attend with this layer's keys/values.
    self.returns_kv = layer in {config.kv_source_layer(j) for j in range(config.num_layers)}

  def __call__(self, x_BxLxD, ctx: dict, window=None, cache_kv=None, return_probs=False,
               return_router_logits=False, fresh_cache=False, extras=None):
    """(x, new cache, probs, router stats, the (k, v) it attended if later layers share them).
    extras (Gemma 4): 'per_layer_input' (B, L, P), 'shared_kv' (an earlier layer's k, v).
    fresh_cache: the cache held nothing before this call (KVCache.empty)."""
    extras = extras or {}
    h = x_BxLxD if self.attn_norm is None else self.attn_norm(x_BxLxD)
    kv_args = {"return_kv": True} if self.returns_kv else {}
    if fresh_cache and isinstance(self.attn, Attention):
      kv_args["fresh_cache"] = True
    if extras.get("shared_kv") is not None:
      kv_args["shared_kv"] = extras["shared_kv"]
    q_seg, k_seg = (ctx["chunk_segments"] if self.chunked
                    else (ctx["q_segment"], ctx["k_segment"]))
    out = self.attn(h, sin_cos=ctx["sin_cos"], q_index_BxL=ctx["q_index"],
                    k_index_BxS=ctx["k_index"], q_segment_BxL=q_seg, k_segment_BxS=k_seg,
                    window=window, cache_kv=cache_kv, cache_index=ctx.get("cache_index"),
                    return_probs=return_probs, positions_BxL=ctx["positions"], **kv_args)
    h, new_cache, probs = out[:3]
    kv = out[3] if len(out) > 3 else None
    if self.post_attn_norm is not None:
      h = self.post_attn_norm(h)
    x_BxLxD = x_BxLxD + h
    stats = None
    normed = x_BxLxD if self.mlp_norm is None else self.mlp_norm(x_BxLxD)
    if isinstance(self.mlp, Gemma4MoE):  # its router and experts read x itself too
      h, stats = self.mlp(normed, x_BxLxD, ctx["q_segment"], return_router_logits)
    elif isinstance(self.mlp, MoE):
      h, stats = self.mlp(normed, ctx["q_segment"], return_router_logits)
    else:
      h = self.mlp(normed)
    if self.post_mlp_norm is not None:
      h = self.post_mlp_norm(h)
    x_BxLxD = constrain(x_BxLxD + h, ("batch", "residual_length", "embed"))
    if self.per_layer is not None:
      x_BxLxD = self.per_layer(x_BxLxD, extras["per_layer_input"])
    if self.scalar is not None:
      x_BxLxD = x_BxLxD * self.scalar[...].astype(x_BxLxD.dtype)
    return x_BxLxD, new_cache, probs, stats, kv


def _stacked_blocks(config: TransformerConfig, rngs: nnx.Rngs) -> Block:
  """One Block whose parameters carry a leading layer axis (logical name 'layers')."""

  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(layer_rngs):
    return Block(config, rngs=layer_rngs)

  blocks = make(rngs)
  for _, node in nnx.iter_graph(blocks):
    if isinstance(node, nnx.Variable):
      node.set_metadata("logical_axes", ("layers",) + tuple(node.get_metadata()["logical_axes"]))
  return blocks


def _without_router_logits(stats: RouterStats | None):
  """(the stats without per-token router logits, those logits or None)."""
  if stats is None or stats.logits_BxLxE is None:
    return stats, None
  return dataclasses.replace(stats, logits_BxLxE=None), stats.logits_BxLxE


class Transformer(nnx.Module):
  """Decoder-only LM of the Llama, Gemma, Qwen and Mistral families."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embedder = Embedder(config, rngs=rngs)
    if config.scan_layers:
      self.layers = _stacked_blocks(config, rngs)
    else:
      self.layers = nnx.List([Block(config, rngs=rngs, layer=i) for i in range(config.num_layers)])
    self.per_layer_inputs = (PerLayerInputs(config, rngs=rngs) if config.per_layer_input_dim
                             else None)
    self.final_norm = RMSNorm(config)
    if config.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = normal_param(rngs, (config.embed_dim, config.vocab_size),
                                  config.embed_dim ** -0.5, config.jnp_param_dtype,
                                  ("embed", "vocab"))

  # ---- output projection -------------------------------------------------------------------

  def output_weight_DxV(self) -> jax.Array:
    """The output layer as one (D, V) matrix in the compute dtype (the tied embedding
    transposed): what a fused projection-and-loss kernel takes instead of `logits_from_hidden`
    (which also applies the soft-cap)."""
    dt = self.config.jnp_dtype
    if self.lm_head is None:
      return self.embedder.embedding[...].astype(dt).T
    return self.lm_head[...].astype(dt)

  def output_operands(self, h_xD: jax.Array) -> list[tuple[jax.Array, jax.Array, int]]:
    """The output layer's matmuls as the step multiplies them, [(input, weight, vocab axis of
    the weight)], summed into the logits before the soft-cap: what a loss over vocabulary
    slices reads instead of whole logits (framework/vocab_slices.py). A plain weight is one
    matmul of h (cast to the compute dtype); a QAT or LoRA wrapper of it says its own
    (`output_operands(h, vocab_axis)`: the rounded weight and input, or the base plus the
    adapter's rank-sized matmul), so a quantized or adapted student's logits stay its own."""
    var, axis = (self.embedder.embedding, 0) if self.lm_head is None else (self.lm_head, 1)
    h_xD = h_xD.astype(self.config.jnp_dtype)
    own = getattr(type(var), "output_operands", None)
    if own is not None:
      return own(var, h_xD, axis)
    return [(h_xD, var[...], axis)]

  def logits_from_hidden(self, h_xD: jax.Array) -> jax.Array:
    """Float32 logits (soft-capped if configured) from final hidden states, any leading shape."""
    dt = self.config.jnp_dtype
    h_xD = h_xD.astype(dt)
    if self.lm_head is None:
      logits = jnp.einsum("...D,VD->...V", h_xD, self.embedder.embedding[...].astype(dt),
                          preferred_element_type=jnp.float32)
    else:
      logits = jnp.einsum("...D,DV->...V", h_xD, self.lm_head[...].astype(dt),
                          preferred_element_type=jnp.float32)
    logits = softcap(logits, self.config.final_logit_softcap)
    if logits.ndim == 3:
      logits = constrain(logits, ("batch", "length", "vocab"))
    return logits

  # ---- forward -----------------------------------------------------------------------------

  def __call__(self, tokens_BxL: jax.Array, *, positions_BxL: jax.Array | None = None,
               segment_ids_BxL: jax.Array | None = None, return_hidden_states: bool = False,
               return_attention: bool = False, cache: KVCache | None = None,
               return_logits: bool = True, return_router_logits: bool = False) -> ModelOutput:
    """Logits for every position.

    positions_BxL: RoPE positions (default 0..L-1, or continuing the cache); restart them per
      packed document. segment_ids_BxL: document id per token, 0 = padding (default all 1).
    cache: a KVCache to extend; this call's tokens are written at `cache.end_index` and attend
      to everything cached before them. The updated cache is returned in the output.
    return_logits: False skips the output projection (logits_BxLxV is None), for losses that
      project `final_hidden_BxLxD` in chunks and for the sampler's prefill.
    return_router_logits: a mixture of experts also returns every layer's router logits.
    """
    cfg = self.config
    B, L = tokens_BxL.shape
    offsets_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    if segment_ids_BxL is None and cache is not None:
      segment_ids_BxL = jnp.ones((B, L), jnp.int32)
    if segment_ids_BxL is not None:  # None: one document, no segment masking at all
      segment_ids_BxL = segment_ids_BxL.astype(jnp.int32)
    if cache is None:
      q_index_BxL = k_index_BxS = offsets_BxL
      k_segment_BxS = segment_ids_BxL
      start = None
    else:
      start = cache.end_index
      q_index_BxL = start + offsets_BxL
      k_index_BxS = jnp.broadcast_to(jnp.arange(cache.length, dtype=jnp.int32), (B, cache.length))
      k_segment_BxS = jax.lax.dynamic_update_slice(cache.segment_ids_BxS, segment_ids_BxL,
                                                   (0, start))
    if positions_BxL is None:
      positions_BxL = q_index_BxL
    ctx = {**_rope_context(positions_BxL, cfg), "q_segment": segment_ids_BxL,
           "k_segment": k_segment_BxS, "q_index": q_index_BxL, "k_index": k_index_BxS,
           "positions": positions_BxL, **({} if start is None else {"cache_index": start})}
    if cfg.attention_chunk_size is not None:  # Llama 4: chunks as segments (attention/chunked)
      ctx["chunk_segments"] = chunk_segments(cfg, ctx)

    x_BxLxD = embedded_BxLxD = self.embedder(tokens_BxL)
    if self.per_layer_inputs is not None:
      ctx["per_layer_inputs"] = self.per_layer_inputs(tokens_BxL, embedded_BxLxD)
    cache_kv = None if cache is None else cache.layer_caches(cfg)
    run = self._run_scanned if cfg.scan_layers else self._run_unrolled
    x_BxLxD, per_layer_x, new_kv, probs, stats = run(
        x_BxLxD, ctx, cache_kv, return_hidden_states,
        (return_attention, return_router_logits, cache is not None and cache.empty))
    stats, router_logits = _without_router_logits(stats)

    final_hidden_BxLxD = self.final_norm(x_BxLxD)
    hidden_states = None
    if return_hidden_states:
      hidden_states = jnp.concatenate([embedded_BxLxD[None], per_layer_x], axis=0)
    new_cache = None
    if cache is not None:
      new_cache = cache.updated(cfg, new_kv, k_segment_BxS, start + L)
    logits = self.logits_from_hidden(final_hidden_BxLxD) if return_logits else None
    return ModelOutput(logits, final_hidden_BxLxD, hidden_states, probs, new_cache, stats,
                       router_logits)

  def _block_fn(self, graphdef, wants: tuple[bool, bool, bool]):
    """A pure (state, x, ctx, window, cache_kv) -> outputs function of one block, remat-wrapped;
    `wants`: (attention probabilities, router logits, the cache empty before this call)."""

    def apply(state, x_BxLxD, ctx, window, cache_kv, extras=None):
      block = nnx.merge(graphdef, state)
      return block(x_BxLxD, ctx, window, cache_kv, *wants, extras=extras)

    if self.config.remat == "none":
      return apply
    return jax.checkpoint(apply, policy=remat.POLICIES[self.config.remat],
                          prevent_cse=not self.config.scan_layers)

  def _run_unrolled(self, x_BxLxD, ctx, cache_kv, want_hidden, wants):
    cfg = self.config
    xs, caches, probs, stats = [], [], [], []
    attended = {}  # Gemma 4: the keys/values of the layers later layers share
    for i, block in enumerate(self.layers):
      graphdef, state = nnx.split(block)
      layer_kv = None if cache_kv is None else cache_kv[i]
      window = cfg.sliding_window if cfg.layer_uses_sliding_window(i) else None
      ctx_i = _layer_rope(ctx, cfg.layer_ropes()[i], cfg.layer_head_dim(i) // 2)
      extras = {"shared_kv": attended.get(cfg.kv_source_layer(i))}
      if "per_layer_inputs" in ctx:
        extras["per_layer_input"] = ctx["per_layer_inputs"][:, :, i]
      with layer_scope.serving((i,), cfg.num_layers):  # plan's per-layer kernel report
        x_BxLxD, new_kv, p, st, kv = self._block_fn(graphdef, wants)(
            state, x_BxLxD, ctx_i, window, layer_kv, extras)
      if kv is not None:
        attended[i] = kv
      if want_hidden:
        xs.append(x_BxLxD)
      if wants[0]:
        probs.append(p)
      if cache_kv is not None:
        caches.append(new_kv)
      if st is not None:
        stats.append(st)
    stack = lambda items: jnp.stack(items) if items else None
    stats = jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats else None
    return x_BxLxD, stack(xs), caches if cache_kv is not None else None, stack(probs), stats

  def _run_scanned(self, x_BxLxD, ctx, cache_kv, want_hidden, wants):
    graphdef, state = nnx.split(self.layers)
    windows = self.config.layer_windows()
    windows = None if windows is None else jnp.asarray(windows, jnp.int32)
    block_fn = self._block_fn(graphdef, wants)
    ropes = jnp.asarray(self.config.layer_ropes(), jnp.int32) if "rope_tables" in ctx else None

    def body(carry, layer):
      x_BxLxD, stacks = carry
      layer_state, window, rope, index = layer
      ctx_i = _layer_rope(ctx, rope)
      slot = None if stacks is None else StackedSlot(stacks, index)
      x_BxLxD, slot, p, st, _ = block_fn(layer_state, x_BxLxD, ctx_i, window, slot)
      stacks = None if slot is None else slot.stacks
      return (x_BxLxD, stacks), (x_BxLxD if want_hidden else None, p, st)

    # The cache rides in the carry, written in place (attention/cache_slot.py says why).
    stacks = None if cache_kv is None else tuple(cache_kv)
    layers = (state, windows, ropes, jnp.arange(self.config.num_layers, dtype=jnp.int32))
    with layer_scope.serving(range(self.config.num_layers), self.config.num_layers):
      (x_BxLxD, new_kv), (xs, probs, stats) = jax.lax.scan(body, (x_BxLxD, stacks), layers)
    return x_BxLxD, xs, new_kv, probs, stats


def _rope_context(positions_BxL, cfg: TransformerConfig) -> dict:
  """{'sin_cos': ...} when every layer turns the same RoPE; else {'rope_tables': ...}, every
  RoPE a layer turns (Gemma 3's local and global bases, SmolLM3's none), picked per layer."""
  if any(cfg.layer_ropes()) or cfg.global_head_dim or cfg.global_rope_fraction != 1.0:
    return {"rope_tables": rope_tables(positions_BxL, cfg)}
  return {"sin_cos": rope_sin_cos(positions_BxL, cfg)}


def _layer_rope(ctx: dict, rope, pairs: int | None = None) -> dict:
  """ctx with one layer's sin/cos: table `rope` (an int, traced under scan) of
  ctx['rope_tables'] when the layers turn different RoPE; ctx as is otherwise."""
  if "rope_tables" not in ctx:
    return ctx
  sin_RxBxLxK2, cos_RxBxLxK2 = ctx["rope_tables"]
  layer_ctx = {k: v for k, v in ctx.items() if k != "rope_tables"}
  pairs = pairs or sin_RxBxLxK2.shape[-1]  # a layer's own width (Gemma 4: head_dim // 2)
  sin_cos = (sin_RxBxLxK2[rope][..., :pairs], cos_RxBxLxK2[rope][..., :pairs])
  return {**layer_ctx, "sin_cos": sin_cos}


# ---- layout conversion -------------------------------------------------------------------------

def layer_params(model: Transformer) -> list[dict[str, Any]]:
  """Per-layer parameter dicts (pure values), whatever the layout."""
  if model.config.scan_layers:
    stacked = nnx.to_pure_dict(nnx.state(model.layers))
    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(model.config.num_layers)]
  return [nnx.to_pure_dict(nnx.state(block)) for block in model.layers]


def with_config(model: Transformer, **changes) -> Transformer:
  """The same weights under a config with `changes` (layout, remat, dtypes, ...).

  Shapes must stay the same; `param_dtype` changes cast the weights. Arrays keep their
  placement except when the layer layout changes (they are restacked).
  """
  config = model.config.replace(**changes)
  values = nnx.to_pure_dict(nnx.state(model))
  if config.scan_layers != model.config.scan_layers:
    per_layer = layer_params(model)
    if config.scan_layers:
      values["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    else:
      values["layers"] = dict(enumerate(per_layer))
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
  want = nnx.to_pure_dict(abstract)
  shapes_of = lambda t: jax.tree.map(lambda x: tuple(x.shape), t)
  if shapes_of(want) != shapes_of(values):
    raise ConfigError(f"with_config({changes}) changes parameter shapes; only numerics, layout "
                      f"and remat may change on an existing model")
  values = jax.tree.map(lambda v, w: v.astype(w.dtype), values, want)
  nnx.replace_by_pure_dict(abstract, values)
  return nnx.merge(graphdef, abstract)


def with_layer_layout(model: Transformer, scan_layers: bool) -> Transformer:
  """The same weights in the unrolled or the stacked (scan) layout."""
  if model.config.scan_layers == scan_layers:
    return model
  return with_config(model, scan_layers=scan_layers)
