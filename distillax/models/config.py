"""`TransformerConfig`: one frozen dataclass for every Llama-, Gemma-, Qwen- and Mistral-family
decoder.

Configs are data (dtypes are names such as 'bfloat16'), so they round-trip through JSON and
ConfigDict overrides. Named configs live in `models/presets.py`; what the fields mean together
(sizes, what each layer is) in `models/derived.py`; what they may hold in `config_checks.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax.numpy as jnp

from distillax.errors import ConfigError
from distillax.models.config_checks import (  # noqa: F401 (the choice lists, re-exported)
    ATTENTION_IMPLS, FULL, GLOBAL_WINDOW, LINEAR, LINEAR_ATTENTION_IMPLS, MLP_ACTIVATIONS,
    MOE_IMPLS, REMAT_POLICIES, ROPE_GLOBAL, ROPE_LOCAL, ROPE_NONE, ROPE_SCALING_TYPES, ROUTERS,
    SLIDING, blocks_sharing_kv, check_config)
from distillax.models.derived import DerivedQuantities

# What a config field is. Every job that compares two configs (a model loaded from a source, a
# run started from another, a workdir resumed) reads the kinds from here, never a list of its own.
SHAPE = "shape"  # what the model is: its arrays and its function (two values, two models)
STORAGE = "storage"  # how its arrays are stored: their dtype and layer layout
COMPUTE = "compute"  # how the forward computes: the same function, tested equal across values
FIELD_KINDS = (SHAPE, STORAGE, COMPUTE)


def _storage(default):
  return dataclasses.field(default=default, metadata={"kind": STORAGE})


def _compute(default):
  return dataclasses.field(default=default, metadata={"kind": COMPUTE})


@dataclasses.dataclass(frozen=True)
class TransformerConfig(DerivedQuantities):
  """Shapes and numerics of a decoder-only LM (Llama 3, Gemma 1-4, Qwen 2/2.5/3/3.5, Mistral,
  SmolLM3, OLMo 3, Phi-3/4, and the mixtures of experts Qwen3-MoE, Mixtral, gpt-oss, Llama 4,
  Qwen3-Next, DeepSeek V3, GLM-4.5).

  A field is SHAPE unless declared `_storage(...)` or `_compute(...)` (see `field_kind`)."""

  vocab_size: int = 256
  embed_dim: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2  # < num_heads: GQA; 1: MQA
  head_dim: int = 16
  mlp_dim: int = 128
  mlp_activation: str = "swiglu"  # 'swiglu' (Llama: silu gate) | 'geglu' (Gemma: tanh-gelu gate)
  norm_eps: float = 1e-6
  norm_scale_plus_one: bool = False  # Gemma RMSNorm: x * (1 + scale), scale initialised at 0
  rope_theta: float = 10_000.0
  # Llama 3.1 "llama3" RoPE frequency scaling; None = plain RoPE.
  rope_scaling_factor: float | None = None
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  # With rope_scaling_factor: 'llama3' (Llama 3.1, the low/high_freq fields) | 'yarn' (gpt-oss)
  # | 'linear' (Gemma 3's global layers: every frequency divided by the factor) | 'longrope'
  # (Phi-3/4: the rope_short_factors / rope_long_factors below).
  rope_scaling_type: str = "llama3"
  rope_yarn_beta_fast: float = 32.0  # yarn: pairs turning more often than this keep their speed
  rope_yarn_beta_slow: float = 1.0  # yarn: pairs turning less often than this are slowed fully
  rope_yarn_truncate: bool = True  # yarn: floor/ceil the ramp's ends (gpt-oss: False)
  rope_attention_factor: float | None = None  # yarn: cos/sin scale; None = 0.1 ln(factor) + 1
  # yarn, DeepSeek's form: with both set, cos/sin are scaled by m(mscale) / m(mscale_all_dim)
  # (m(x) = 0.1 x ln(factor) + 1); with mscale_all_dim set the attention scale is multiplied by
  # m(mscale_all_dim)^2; 0 = unset.
  rope_yarn_mscale: float = 0.0
  rope_yarn_mscale_all_dim: float = 0.0  # yarn, DeepSeek's: m(this)^2 scales the attention
  rope_interleaved: bool = False  # DeepSeek's rope_interleave: RoPE turns adjacent feature pairs
  # Gemma 3: the RoPE base of the sliding-window layers, which turn unscaled (rope_theta and its
  # scaling are then the global layers'); None = every layer turns as rope_theta says.
  rope_local_theta: float | None = None
  rope_free_layers: tuple[int, ...] | None = None  # SmolLM3: layers without RoPE; None = none
  tie_embeddings: bool = False  # output projection = embedding table transposed
  scale_embeddings: bool = False  # Gemma: embeddings multiplied by sqrt(embed_dim)
  attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(logits / cap) on attention scores
  final_logit_softcap: float | None = None  # Gemma 2: the same on the output logits
  query_pre_attn_scalar: float | None = None  # attention scale is this**-0.5 (default head_dim)
  sliding_window: int | None = None  # local attention span for the layers that use it
  # With sliding_window set: layer i (0-based) attends globally iff (i + 1) % pattern == 0 and
  # locally otherwise (Gemma 2: 2 = local, global, local, ...); 0 = every layer local.
  sliding_window_pattern: int = 2
  # With sliding_window set: SLIDING or FULL per layer (HF's layer_types), for layers that follow
  # no pattern, e.g. a student made of teacher blocks keeps each block's own; None = by pattern.
  layer_types: tuple[str, ...] | None = None
  use_post_norms: bool = False  # Gemma 2: RMSNorm after attention and after the MLP too
  qkv_bias: bool = False  # Qwen 2/2.5: the q, k and v projections add a bias (o does not)
  qk_norm: bool = False  # Qwen 3: RMSNorm over head_dim on each query and key head, before RoPE
  attn_out_bias: bool = False  # gpt-oss: the o projection adds a bias too
  attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax's sum
  # DeepSeek V2/V3 multi-head latent attention (models/attention/mla.py): each token's keys and
  # values come from a kv_lora_rank-wide latent (what the KV cache holds) plus one RoPE key of
  # qk_rope_head_dim features every head shares; head_dim is a query/key head's width, its last
  # qk_rope_head_dim features turned by RoPE. 0 = ordinary attention.
  kv_lora_rank: int = 0
  q_lora_rank: int = 0  # MLA: queries through a normed bottleneck this wide; 0 = projected directly
  qk_rope_head_dim: int = 0  # MLA: the RoPE features of each query/key head
  v_head_dim: int = 0  # MLA: value features per head; 0 = head_dim
  max_seq_len: int = 2048
  # Qwen3.5 (models/gated_deltanet.py): per layer LINEAR (a Gated DeltaNet linear-attention
  # layer) or FULL attention, as HF's layer_types names them; None = attention in every layer.
  token_mixers: tuple[str, ...] | None = None
  linear_num_key_heads: int = 2  # Gated DeltaNet query/key heads
  linear_num_value_heads: int = 4  # Gated DeltaNet value heads, a multiple of its key heads
  linear_key_head_dim: int = 16  # Gated DeltaNet query/key features per head
  linear_value_head_dim: int = 16  # Gated DeltaNet value features per head
  linear_conv_kernel: int = 4  # Gated DeltaNet: taps of the causal depthwise conv on q, k, v
  partial_rotary_factor: float = 1.0  # share of head_dim that RoPE turns (Qwen3.5: 0.25)
  attn_output_gate: bool = False  # Qwen3.5: attention output times sigmoid(gate projection of x)
  # OLMo 2/3: no norm before attention and the MLP; only the post norms (use_post_norms) after.
  pre_norms: bool = True
  # OLMo 2/3: the q/k RMSNorm runs over all heads of a projection at once (one scale per head
  # and feature), not over each head's head_dim alone; needs qk_norm.
  qk_norm_across_heads: bool = False
  # Phi-3/4 LongRoPE (rope_scaling_type 'longrope'): a divisor per turning frequency pair, the
  # short ones while a call's positions stay below rope_original_max_len, the long ones past it
  # (transformers' rule); rope_scaling_factor sets the default cos/sin scale
  # sqrt(1 + ln(factor) / ln(rope_original_max_len)).
  rope_short_factors: tuple[float, ...] | None = None
  rope_long_factors: tuple[float, ...] | None = None
  # Phi-3/4 checkpoints store q, k and v as one projection and gate and up as another (HF's
  # qkv_proj / gate_up_proj, llama.cpp's attn_qkv / ffn_up); distillax computes with them apart.
  # The same function as Llama's, but which checkpoint the model is: kept with it, as a shape.
  fused_qkv_gate_up: bool = False
  # Qwen3-Next checkpoints store a Gated DeltaNet layer's q, k, v and z as one in_proj_qkvz and
  # b, a as one in_proj_ba, grouped by key head; Qwen3.5's the same function stored apart.
  fused_qkvz_ba: bool = False
  # Llama 4: the layers with RoPE attend within chunks of this many positions (a query sees the
  # keys of its own chunk, position // size); the RoPE-free layers attend fully; None = off.
  attention_chunk_size: int | None = None
  # Llama 4: a scale-free RMS norm of each query and key head after RoPE, in the RoPE layers.
  qk_l2_norm: bool = False
  # Llama 4's temperature tuning of the RoPE-free layers: queries times
  # log1p(floor((position + 1) / floor_scale)) * attn_temperature_scale + 1; None = off.
  attn_temperature_floor_scale: int | None = None
  attn_temperature_scale: float = 0.1
  # Gemma 4 (models/per_layer_inputs.py): width of each layer's extra input from a second token
  # table and a projection of the embeddings, gated into the residual after the MLP; 0 = off.
  per_layer_input_dim: int = 0
  per_layer_input_vocab_size: int = 0  # Gemma 4: rows of that second table; 0 = vocab_size
  # Gemma 4: the last this-many layers compute no keys/values of their own; each attends with
  # those of the last earlier layer of its own attention type (sliding / full).
  num_kv_shared_layers: int = 0
  value_norm: bool = False  # Gemma 4: RMSNorm without a scale on every value head
  layer_scalar: bool = False  # Gemma 4: each block's output times a learned per-layer scalar
  global_head_dim: int = 0  # Gemma 4: head_dim of the full-attention layers; 0 = head_dim
  # Gemma 4's proportional RoPE on full layers: the first this share of each head's frequency
  # pairs turn at rope_theta^(-2i/head_dim), the rest stand still; 1 = ordinary RoPE.
  global_rope_fraction: float = 1.0
  double_wide_shared_mlp: bool = False  # Gemma 4: layers sharing k/v have MLPs 2 x mlp_dim wide
  # Gemma 4 31B (HF attention_k_eq_v): full-attention layers have no v projection; their values
  # are their keys before k_norm and RoPE (then value-normed).
  attention_k_eq_v: bool = False
  global_num_kv_heads: int = 0  # Gemma 4: k/v heads of the full-attention layers; 0 = num_kv_heads
  # Mixture of experts (models/moe/layer.py): the MLP of the layers moe_layers names becomes
  # num_experts gated experts and a router; 0 = a dense MLP in every layer (the other MoE fields
  # are then unused).
  num_experts: int = 0
  num_experts_per_tok: int = 2  # experts each token is routed to (k)
  moe_mlp_dim: int = 0  # hidden width of each expert; 0 = mlp_dim
  # Which layers' MLP is routed experts, the others a dense MLP of width mlp_dim (DeepSeek's and
  # GLM's first_k_dense_replace, Qwen3-MoE's mlp_only_layers / decoder_sparse_step, Llama 4's
  # moe_layers / interleave_moe_layer_step); None = every layer (when num_experts > 0).
  moe_layers: tuple[int, ...] | None = None
  # 'softmax_topk' (Qwen3-MoE) | 'topk_softmax' (Mixtral, gpt-oss) | 'gemma4' (softmax_topk
  # renormalised over a scale-free-normed, learned-scaled input, times a learned per-expert scale)
  # | 'sigmoid' (DeepSeek V3, GLM-4.5, Llama 4: each expert's sigmoid score, the k best kept)
  router: str = "softmax_topk"
  # Gemma 4 26B (models/moe/gemma4.py): a dense MLP beside the experts, each branch with its own
  # norms, the router reading the residual stream itself; goes with router='gemma4'.
  moe_dense_mlp: bool = False
  # softmax_topk and sigmoid: rescale the k kept probabilities (scores) to sum to 1
  norm_topk_prob: bool = False
  # sigmoid (DeepSeek's e_score_correction_bias): a per-expert bias added to the scores to choose
  # the experts, never to weight them (auxiliary-loss-free balancing)
  router_score_bias: bool = False
  # sigmoid, group-limited top-k (DeepSeek's n_group / topk_group): the experts form this many
  # groups of consecutive indices, each group scored by the sum of its two best scores, and
  # only the best router_groups_kept groups' experts may be chosen; 1 = no groups.
  router_groups: int = 1
  router_groups_kept: int = 1  # sigmoid: the groups whose experts may be chosen (topk_group)
  routed_scaling_factor: float = 1.0  # every routing weight times this (DeepSeek: 2.5)
  # Llama 4: a token's chosen expert runs on its input times the routing weight (rather than
  # weighting the expert's output); needs num_experts_per_tok=1.
  moe_scale_inputs: bool = False
  router_bias: bool = False  # gpt-oss: the router adds a learned bias per expert to its logits
  expert_bias: bool = False  # gpt-oss: every expert's gate, up and down projections add biases
  # Qwen3.5-MoE (models/moe/shared.py): a dense gated MLP this wide beside the routed experts of
  # every MoE layer, its output added to theirs; 0 = none.
  shared_expert_mlp_dim: int = 0
  shared_expert_gate: bool = False  # the shared expert's output times sigmoid(x @ w), w (embed, 1)
  swiglu_alpha: float = 1.702  # mlp_activation 'clamped_swiglu': gate * sigmoid(alpha * gate)
  swiglu_limit: float = 7.0  # 'clamped_swiglu': gate clamped above, up both sides, at this
  param_dtype: str = _storage("float32")
  dtype: str = _compute("float32")  # compute dtype; softmax and norms always run in float32
  scan_layers: bool = _storage(False)  # stack layers and run them with lax.scan (flat compile)
  # 'none' | 'full' | 'save_dots' | 'save_dots_no_batch' | 'save_attention' |
  # 'save_attention_qkv' | 'save_attention_up' | 'save_attention_mlp' (models/remat.py). On
  # XLA:CPU it saves memory only with scan_layers=True (unrolled, XLA schedules the
  # recomputation early; benchmarks/peft.py).
  remat: str = _compute("none")
  # auto | reference | blockwise | cudnn | splash | tokamax: how attention runs
  # (models/attention/impl.py; tokamax: its Mosaic GPU flash kernel, the tokamax extra).
  attention_impl: str = _compute("auto")
  # Splash attention's tiles (TPU): (block_q, block_kv, block_kv_compute) positions, each a
  # multiple of 128 that divides the sequence (else the largest of 512, 256, 128 that does), and
  # whether the backward pass is one fused dq/dkv kernel. The defaults were the v5e's fastest
  # (benchmarks/results/splash_blocks.json: forward + backward 1.32x the 512 tiles with two
  # backward kernels at 2k tokens, head dim 128 and 64; 1.50x at 8k).
  splash_blocks: tuple[int, int, int] = _compute((1024, 1024, 512))
  splash_fused_bwd: bool = _compute(True)
  # ragged (dropless grouped matmul, the default) | dense (every expert on every token; the
  # reference the tests hold ragged to) | tokamax (tokamax's grouped matmul: moe/kernels.py).
  moe_impl: str = _compute("ragged")
  # Expert capacity: each expert takes at most ceil(factor * tokens * k / num_experts) of a layer
  # call's assignments, the rest dropped (models/moe/layer.py); None = dropless. A training-time limit,
  # not stored weights, so a student from a source (HF, teacher blocks, a run) may set it.
  moe_capacity_factor: float | None = _compute(None)
  # chunked (training: chunk-parallel, O(L * chunk) memory) | recurrent (one token at a time,
  # the reference the tests hold chunked to): how Gated DeltaNet layers run (linear_attention.py).
  linear_attention_impl: str = _compute("chunked")
  linear_attention_chunk: int = _compute(64)  # tokens per chunk of the chunked form

  def __post_init__(self):
    check_config(self)

  # ---- derived quantities (models/derived.py: sizes and what each layer is) ---------------

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  def select_layers(self, layers: Sequence[int]) -> "TransformerConfig":
    """The config of a model made of this one's blocks `layers` (in that order): each block
    attends as it was trained to (a Gemma 2 block copied from a sliding layer to an odd
    position stays sliding; a Gemma 3 block keeps its RoPE base with its attention type; a
    SmolLM3 block without RoPE stays without, a Qwen3.5 block keeps its token mixer, a Gemma 4
    block its head_dim, RoPE and the block whose keys/values it shares, a mixture of experts'
    block its experts or dense MLP), whatever pattern its new
    position would give. Gemma 4's per-layer input columns follow their blocks in the weights
    (trainers/sources/kinds.py)."""
    local = [self.layer_uses_sliding_window(i) for i in layers]
    mixers = None if self.token_mixers is None else tuple(self.token_mixers[i] for i in layers)
    free = tuple(j for j, i in enumerate(layers) if i in (self.rope_free_layers or ()))
    shared = blocks_sharing_kv(self, layers)
    moe = (tuple(j for j, i in enumerate(layers) if self.layer_is_moe(i)) if self.num_experts
           else None)
    return self.replace(**{"num_layers": len(layers), "token_mixers": mixers, "moe_layers": moe,
                           "rope_free_layers": free or None, "num_kv_shared_layers": shared,
                           "double_wide_shared_mlp": self.double_wide_shared_mlp and shared > 0,
                           **window_fields(self.sliding_window, local)})

  # ---- data round trip -------------------------------------------------------------------

  def replace(self, **changes) -> "TransformerConfig":
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
    if unknown:
      raise ConfigError(f"unknown model config field(s) {unknown}; known fields: "
                        f"{', '.join(f.name for f in dataclasses.fields(self))}")
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """The fields as JSON holds them: tuples (layer lists, splash tiles) as lists, so a dict
    written and read back equals the one written."""
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(self).items()}

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "TransformerConfig":
    """From a dict/ConfigDict of fields (a 'preset' key: `presets.config_from_dict`)."""
    return cls().replace(**dict(values))


def field_kind(name: str) -> str:
  """SHAPE, STORAGE or COMPUTE: what the TransformerConfig field `name` is."""
  for f in dataclasses.fields(TransformerConfig):
    if f.name == name:
      return f.metadata.get("kind", SHAPE)
  raise ConfigError(f"unknown model config field {name!r}")


def fields_of_kind(*kinds: str) -> tuple[str, ...]:
  """The TransformerConfig fields of any of `kinds`, in declaration order."""
  unknown = set(kinds) - set(FIELD_KINDS)
  if unknown:
    raise ValueError(f"unknown field kinds {sorted(unknown)}; kinds: {FIELD_KINDS}")
  return tuple(f.name for f in dataclasses.fields(TransformerConfig)
               if f.metadata.get("kind", SHAPE) in kinds)


def window_fields(window: int | None, local: Sequence[bool]) -> dict[str, Any]:
  """sliding_window, sliding_window_pattern and layer_types of per-layer local (True) / global
  attention, in the one form that says it (so equal models have equal configs): no window when
  no layer is local, a pattern when the layers follow one (every p-th layer global; 0 = none),
  else the per-layer types."""
  local = [bool(x) for x in local]
  if window is None or not any(local):
    return {"sliding_window": None, "layer_types": None}
  pattern = 0 if all(local) else local.index(False) + 1
  if local == [pattern == 0 or (i + 1) % pattern != 0 for i in range(len(local))]:
    return {"sliding_window": int(window), "sliding_window_pattern": pattern,
            "layer_types": None}
  return {"sliding_window": int(window), "sliding_window_pattern": 2,  # unused with types
          "layer_types": tuple(SLIDING if x else FULL for x in local)}
