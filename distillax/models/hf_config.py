"""Hugging Face `config.json` <-> TransformerConfig for Llama, Gemma, Gemma 2, Gemma 3, Qwen
2/2.5, Qwen 3, Mistral, SmolLM3, and the mixtures of experts Qwen3-MoE, Mixtral and gpt-oss.

Reads both the transformers 5 layout (`rope_parameters`) and the older one (`rope_theta` +
`rope_scaling`), and writes both so other readers (older transformers, serving stacks) agree.
The families differ only in a few switches: Gemma's GeGLU / (1 + w) norms / sqrt(D) embeddings,
Gemma 2's post norms, soft-caps and alternating sliding window, Qwen 2's q/k/v biases, Qwen 3's
q/k RMSNorm, Mistral's sliding window on every layer; Qwen3-MoE is Qwen 3 with experts in every
layer (softmax then top-k, `norm_topk_prob`), Mixtral is Mistral with experts (top-k then
softmax). gpt-oss adds biases (q/k/v/o, router, experts), attention sinks, the clamped SwiGLU,
YaRN RoPE and alternating sliding / full layers. Qwen3.5's dense text decoder mixes Gated
DeltaNet and gated full-attention layers by `layer_types`, with partial RoPE. Gemma 3 is Gemma
2 with q/k norms, five sliding layers in six and a RoPE per layer type (`rope_parameters` keyed
by layer type: the sliding layers' base, the global layers' with linear scaling); SmolLM3 is
Llama with no RoPE where `no_rope_layers` says 0. Per-layer `layer_types` that follow no pattern
(a Gemma 2 student made of teacher blocks) are read and, for Gemma 2 and gpt-oss, written as they
are.
"""

from __future__ import annotations

from typing import Any, Mapping

from distillax.errors import UserError
from distillax.models.config import FULL, LINEAR, SLIDING, TransformerConfig, window_fields
from distillax.models.hf_gemma4 import GEMMA4, gemma4_fields, gemma4_hf_fields, is_gemma4

_MODEL_TYPES = {"llama": "LlamaForCausalLM", "gemma": "GemmaForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "gpt_oss": "GptOssForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                "gemma4_text": "Gemma4ForCausalLM"}
GPT_OSS = "GptOssForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
SMOLLM3 = "SmolLM3ForCausalLM"
# Multimodal wrappers whose text decoder distillax reads (text_config; weights under a prefix).
MULTIMODAL = {"Gemma4ForConditionalGeneration": GEMMA4,
              "Gemma3ForConditionalGeneration": GEMMA3}
QWEN35 = "Qwen3_5ForCausalLM"
ARCHITECTURES = tuple(_MODEL_TYPES.values())
_GEMMA_FAMILY = ("GemmaForCausalLM", "Gemma2ForCausalLM", GEMMA3)
_QWEN_FAMILY = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_MISTRAL_FAMILY = ("MistralForCausalLM", "MixtralForCausalLM")
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu")  # Gemma's 'gelu' means tanh


def supported_architectures() -> str:
  """'LlamaForCausalLM (llama), ...': what an error about an unsupported model names."""
  return ", ".join(f"{arch} ({model_type})" for model_type, arch in _MODEL_TYPES.items())


def text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
  """The text decoder's config of a multimodal wrapper's config.json (the config as is
  otherwise), with the wrapper's text architecture named."""
  archs = hf.get("architectures") or []
  if archs and archs[0] in MULTIMODAL and isinstance(hf.get("text_config"), Mapping):
    return {**hf["text_config"], "architectures": [MULTIMODAL[archs[0]]]}
  return hf


def architecture_of(hf: Mapping[str, Any], where: str) -> str:
  """The HF class of a config dict (`architectures[0]`, else from `model_type`), if supported."""
  hf = text_config(hf)
  archs = hf.get("architectures") or []
  model_type = hf.get("model_type")
  arch = archs[0] if archs else _MODEL_TYPES.get(str(model_type), "")
  if arch not in ARCHITECTURES:
    named = repr(arch or model_type)
    if arch and model_type:
      named += f" (model_type {model_type!r})"
    raise UserError(f"{where}: unsupported architecture {named}; distillax imports "
                    f"{supported_architectures()}")
  return arch


def _rope(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
  params = dict(hf.get("rope_parameters") or {})
  legacy = dict(hf.get("rope_scaling") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
  rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
  scaling = params if params.get("rope_type") in ("llama3", "yarn", "linear") else legacy
  if rope_type == "default":
    return {"rope_theta": float(theta)}
  if rope_type == "yarn":
    return _yarn(scaling, float(theta), where)
  if rope_type == "linear":
    return {"rope_theta": float(theta), "rope_scaling_type": "linear",
            "rope_scaling_factor": float(scaling["factor"])}
  if rope_type == "llama3":
    return {"rope_theta": float(theta), "rope_scaling_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_len": int(scaling["original_max_position_embeddings"])}
  raise UserError(f"{where}: unsupported RoPE type {rope_type!r}; supported: default, llama3, "
                  f"yarn, linear")


def _yarn(scaling: Mapping[str, Any], theta: float, where: str) -> dict[str, Any]:
  """YaRN as transformers 5.24 computes it (beta 32/1 and truncate on by default)."""
  if scaling.get("mscale") or scaling.get("mscale_all_dim"):
    raise UserError(f"{where}: yarn mscale={scaling.get('mscale')}, mscale_all_dim="
                    f"{scaling.get('mscale_all_dim')} is not supported (DeepSeek's form); "
                    f"distillax reads yarn with attention_factor or its default")
  if scaling.get("factor") is None or scaling.get("original_max_position_embeddings") is None:
    raise UserError(f"{where}: yarn RoPE needs 'factor' and 'original_max_position_embeddings'")
  factor = scaling.get("attention_factor")
  return {"rope_theta": theta, "rope_scaling_type": "yarn",
          "rope_scaling_factor": float(scaling["factor"]),
          "rope_original_max_len": int(scaling["original_max_position_embeddings"]),
          "rope_yarn_beta_fast": float(scaling.get("beta_fast") or 32),
          "rope_yarn_beta_slow": float(scaling.get("beta_slow") or 1),
          "rope_yarn_truncate": bool(scaling.get("truncate", True)),
          "rope_attention_factor": None if factor is None else float(factor)}


def _window_pattern(window, types: list[str], num_layers: int, where: str) -> dict[str, Any]:
  """sliding_window + sliding_window_pattern (or, for layers that follow no pattern, the
  per-layer layer_types) of HF `layer_types`."""
  if len(types) != num_layers:
    raise UserError(f"{where}: layer_types has {len(types)} entries for num_hidden_layers="
                    f"{num_layers}; fix the config.json")
  unknown = sorted(set(types) - {SLIDING, FULL})
  if unknown:
    raise UserError(f"{where}: layer_types has {unknown}; distillax runs {SLIDING!r} and "
                    f"{FULL!r} layers")
  return window_fields(window, [t == SLIDING for t in types])


def _sliding(hf: Mapping[str, Any], arch: str, num_layers: int, where: str) -> dict[str, Any]:
  """Which layers attend locally, as each family's transformers code decides it."""
  window = hf.get("sliding_window")
  if arch in _MISTRAL_FAMILY:  # every layer (transformers ignores Mistral layer_types)
    return _window_pattern(window, [SLIDING] * num_layers, num_layers, where)
  if arch in _QWEN_FAMILY:  # only with use_sliding_window; by default layers >= max_window_layers
    if not hf.get("use_sliding_window"):
      return {"sliding_window": None}
    first_local = int(hf.get("max_window_layers", 28))
    types = hf.get("layer_types") or [SLIDING if i >= first_local else FULL
                                      for i in range(num_layers)]
    return _window_pattern(window, types, num_layers, where)
  types = hf.get("layer_types") or [  # Gemma 2: local, global, local, ...
      SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
  return _window_pattern(window, types, num_layers, where)


def _gemma3_fields(hf: Mapping[str, Any], num_layers: int, where: str) -> dict[str, Any]:
  """Gemma 3: Gemma 2's post norms and query scalar, q/k norms, sliding layers 5:1 (layer_types,
  else sliding_window_pattern), and a RoPE per kind of layer: the sliding layers' base (10k,
  unscaled), the global layers' (1M, linear x8 in the 4B and larger checkpoints)."""
  if hf.get("use_bidirectional_attention"):
    raise UserError(f"{where}: use_bidirectional_attention=true is not supported (distillax "
                    f"trains causal decoders); set it to false")
  pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
  types = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL
                                    for i in range(num_layers)]
  ropes = dict(hf.get("rope_parameters") or {})
  if FULL in ropes or SLIDING in ropes:  # transformers 5: one RoPE per layer type
    global_rope = {"rope_parameters": ropes.get(FULL) or {}, "rope_theta": 1_000_000.0}
    local = dict(ropes.get(SLIDING) or {})
  else:  # transformers 4's keys: rope_theta + rope_scaling (global), rope_local_base_freq
    global_rope = {"rope_theta": hf.get("rope_theta", 1_000_000.0),
                   "rope_scaling": hf.get("rope_scaling")}
    local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
  if local.get("rope_type", "default") != "default":
    raise UserError(f"{where}: sliding_attention rope_type={local['rope_type']!r} is not "
                    f"supported; distillax turns Gemma 3's sliding layers with default RoPE")
  return dict(use_post_norms=True, qk_norm=True,
              attn_logit_softcap=hf.get("attn_logit_softcapping"),
              final_logit_softcap=hf.get("final_logit_softcapping"),
              query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
              **{"rope_scaling_factor": None, **_rope(global_rope, where)},
              rope_local_theta=float(local.get("rope_theta", 10_000.0)),
              **_window_pattern(hf.get("sliding_window", 4096), types, num_layers, where))


def _smollm3_fields(hf: Mapping[str, Any], num_layers: int, where: str) -> dict[str, Any]:
  """SmolLM3: Llama with no RoPE in the layers no_rope_layers marks 0 (by default every
  no_rope_layer_interval-th, the 4th)."""
  if hf.get("use_sliding_window"):
    raise UserError(f"{where}: use_sliding_window=true is not supported for {SMOLLM3}; "
                    f"distillax reads SmolLM3 with full attention in every layer")
  interval = int(hf.get("no_rope_layer_interval", 4))
  flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
  if len(flags) < num_layers:
    raise UserError(f"{where}: no_rope_layers has {len(flags)} entries for num_hidden_layers="
                    f"{num_layers}; fix the config.json")
  return dict(rope_free_layers=tuple(i for i in range(num_layers) if not flags[i]) or None)


def _gpt_oss_fields(hf: Mapping[str, Any], num_layers: int, where: str) -> dict[str, Any]:
  """gpt-oss: biased attention with sinks, alternating sliding / full layers, biased router
  (top-k then softmax) and biased experts with the clamped SwiGLU."""
  bias = bool(hf.get("attention_bias", True))
  types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
  return dict(qkv_bias=bias, attn_out_bias=bias, attention_sinks=True,
              num_experts=int(hf["num_local_experts"]),
              num_experts_per_tok=int(hf["num_experts_per_tok"]), router="topk_softmax",
              router_bias=True, expert_bias=True, mlp_activation="clamped_swiglu",
              swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
              swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
              **_window_pattern(hf.get("sliding_window"), types, num_layers, where))


def _qwen35_fields(hf: Mapping[str, Any], act, num_layers: int, where: str) -> dict[str, Any]:
  """Qwen3.5 (dense text decoder): Gated DeltaNet and gated full-attention layers by
  layer_types (default: every 4th full), partial RoPE, q/k norms, (1 + w) norms."""
  if (act or "silu") != "silu":
    raise UserError(f"{where}: hidden_act={act!r} is not supported for {QWEN35} (only silu)")
  interval = int(hf.get("full_attention_interval", 4))
  types = list(hf.get("layer_types") or [FULL if (i + 1) % interval == 0 else LINEAR
                                         for i in range(num_layers)])
  if len(types) != num_layers or set(types) - {LINEAR, FULL}:
    raise UserError(f"{where}: layer_types={types} must name {LINEAR!r} or {FULL!r} for each "
                    f"of num_hidden_layers={num_layers} layers; fix the config.json")
  rope = dict(hf.get("rope_parameters") or {})
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
  return dict(mlp_activation="swiglu", qk_norm=True, norm_scale_plus_one=True,
              attn_output_gate=True, partial_rotary_factor=float(partial),
              token_mixers=tuple(types),
              linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
              linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
              linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
              linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
              linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)))


def _is_qwen35(config: TransformerConfig) -> bool:
  """Whether Qwen3_5ForCausalLM holds the config: its fixed parts (gated attention with q/k
  norms, (1 + w) norms, SwiGLU) and nothing of the other families."""
  return (config.attn_output_gate and config.qk_norm and config.norm_scale_plus_one
          and config.mlp_activation == "swiglu" and not config.num_experts
          and not (config.qkv_bias or config.scale_embeddings or config.use_post_norms
                   or config.attn_logit_softcap or config.final_logit_softcap
                   or config.query_pre_attn_scalar or config.sliding_window
                   or config.rope_scaling_factor or config.attention_sinks
                   or config.attn_out_bias))


def _moe_fields(hf: Mapping[str, Any], arch: str, where: str) -> dict[str, Any]:
  """The expert fields of Qwen3-MoE (experts in every layer only) and Mixtral."""
  if arch == "MixtralForCausalLM":
    return dict(num_experts=int(hf["num_local_experts"]),
                num_experts_per_tok=int(hf["num_experts_per_tok"]), router="topk_softmax")
  if arch != "Qwen3MoeForCausalLM":
    return {}
  step, dense_layers = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
  if step != 1 or dense_layers:
    raise UserError(f"{where}: decoder_sparse_step={step}, mlp_only_layers={dense_layers}: "
                    f"distillax runs Qwen3-MoE with experts in every layer (step 1, no dense "
                    f"layers)")
  return dict(num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
              num_experts_per_tok=int(hf["num_experts_per_tok"]),
              moe_mlp_dim=int(hf["moe_intermediate_size"]), router="softmax_topk",
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _family_fields(hf: Mapping[str, Any], arch: str, num_layers: int,
                   where: str) -> dict[str, Any]:
  """The TransformerConfig switches of one architecture."""
  act = hf.get("hidden_activation") or hf.get("hidden_act")
  if arch == GPT_OSS:  # its experts' activation is fixed by the class (hidden_act is unused)
    return _gpt_oss_fields(hf, num_layers, where)
  if arch == QWEN35:
    return _qwen35_fields(hf, act, num_layers, where)
  if arch == GEMMA4:
    if (act or "gelu_pytorch_tanh") not in _TANH_GELU:
      raise UserError(f"{where}: hidden activation {act!r} is not supported for {arch} "
                      f"(only gelu_pytorch_tanh)")
    return gemma4_fields(hf, num_layers, where)
  if arch not in _GEMMA_FAMILY:
    if (act or "silu") != "silu":
      raise UserError(f"{where}: hidden_act={act!r} is not supported for {arch} (only silu)")
    fields: dict[str, Any] = dict(mlp_activation="swiglu", qkv_bias=arch == "Qwen2ForCausalLM",
                                  qk_norm=arch in _QK_NORM)
    if arch in _QWEN_FAMILY or arch in _MISTRAL_FAMILY:
      fields.update(_sliding(hf, arch, num_layers, where))
    if arch == SMOLLM3:
      fields.update(_smollm3_fields(hf, num_layers, where))
    fields.update(_moe_fields(hf, arch, where))
    return fields
  if (act or "gelu_pytorch_tanh") not in _TANH_GELU:
    raise UserError(f"{where}: hidden activation {act!r} is not supported for Gemma "
                    f"(only gelu_pytorch_tanh)")
  fields = dict(mlp_activation="geglu", norm_scale_plus_one=True, scale_embeddings=True)
  if arch == "Gemma2ForCausalLM":
    fields.update(use_post_norms=True, attn_logit_softcap=hf.get("attn_logit_softcapping"),
                  final_logit_softcap=hf.get("final_logit_softcapping"),
                  query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                  **_sliding(hf, arch, num_layers, where))
  if arch == GEMMA3:
    fields.update(_gemma3_fields(hf, num_layers, where))
  return fields


def config_from_hf(hf: Mapping[str, Any], *, where: str = "config.json",
                   dtype: str | None = None, **overrides) -> TransformerConfig:
  """The TransformerConfig of a HF config dict (a multimodal wrapper's: its text decoder's).
  `dtype` sets both param and compute dtype."""
  arch = architecture_of(hf, where)
  hf = text_config(hf)
  quant = (hf.get("quantization_config") or {}).get("quant_method")
  if quant is not None and not (arch == GPT_OSS and quant == "mxfp4"):
    raise UserError(f"{where}: quantization_config quant_method={quant!r} is not supported; "
                    f"distillax reads unquantized checkpoints and gpt-oss's mxfp4 experts")
  for flag in ("attention_bias", "mlp_bias"):  # Qwen 2's fixed q/k/v biases carry no flag
    if hf.get(flag) and arch != GPT_OSS:
      raise UserError(f"{where}: {flag}=true is not supported (distillax has biases only on "
                      f"the q/k/v projections of Qwen2ForCausalLM)")
  heads = int(hf["num_attention_heads"])
  fields: dict[str, Any] = dict(
      vocab_size=int(hf["vocab_size"]), embed_dim=int(hf["hidden_size"]),
      num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
      mlp_dim=int(hf["intermediate_size"]), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      max_seq_len=int(hf.get("max_position_embeddings", 2048)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", arch in _GEMMA_FAMILY + (GEMMA4,))),
      **_rope(hf, where))
  fields.update(_family_fields(hf, arch, fields["num_layers"], where))
  if dtype is not None:
    fields.update(param_dtype=str(dtype), dtype=str(dtype))
  fields.update(overrides)
  return TransformerConfig(**fields)


def _moe_architecture(config: TransformerConfig, every_or_no_layer_local: bool) -> str | None:
  """Qwen3-MoE or Mixtral for a SwiGLU mixture of experts, or None when neither holds it."""
  if config.qkv_bias:
    return None
  if config.qk_norm and config.router == "softmax_topk":
    return "Qwen3MoeForCausalLM" if every_or_no_layer_local else None
  if not config.qk_norm and config.router == "topk_softmax":
    return "MixtralForCausalLM" if every_or_no_layer_local else None
  return None


def _swiglu_architecture(config: TransformerConfig) -> str | None:
  """Llama, Qwen 2, Qwen 3 or Mistral (Qwen3-MoE or Mixtral with experts) for a SwiGLU config,
  or None when none holds it."""
  local = config.local_layers()
  every_or_no_layer_local = all(local) or not any(local)
  if config.num_experts:
    return _moe_architecture(config, every_or_no_layer_local)
  if config.qkv_bias and config.qk_norm:
    return None  # Qwen 3's attention_bias also biases o_proj
  if config.qkv_bias:
    return "Qwen2ForCausalLM" if every_or_no_layer_local else None
  if config.qk_norm:
    return "Qwen3ForCausalLM" if every_or_no_layer_local else None
  if not any(local):
    return "LlamaForCausalLM"
  return "MistralForCausalLM" if all(local) else None


def _is_gpt_oss(config: TransformerConfig) -> bool:
  """Whether GptOssForCausalLM holds the config: every gpt-oss part, one attention_bias flag
  for q/k/v and o, nothing of the other families."""
  return (config.attention_sinks and config.router_bias and config.expert_bias
          and config.mlp_activation == "clamped_swiglu" and config.num_experts > 0
          and config.router == "topk_softmax" and config.qkv_bias == config.attn_out_bias
          and not (config.qk_norm or config.norm_scale_plus_one or config.scale_embeddings
                   or config.use_post_norms or config.attn_logit_softcap
                   or config.final_logit_softcap or config.query_pre_attn_scalar)
          and (config.rope_scaling_factor is None or config.rope_scaling_type == "yarn"))


def hf_architecture(config: TransformerConfig) -> str:
  """Which HF class can hold this config, or a UserError naming the feature that none can."""
  gemma_like = (config.mlp_activation == "geglu" and config.norm_scale_plus_one
                and config.scale_embeddings)
  llama_like = (config.mlp_activation == "swiglu" and not config.norm_scale_plus_one
                and not config.scale_embeddings)
  gemma2_only = (config.use_post_norms, config.attn_logit_softcap, config.final_logit_softcap,
                 config.query_pre_attn_scalar)
  qwen_only = (config.qkv_bias, config.qk_norm)
  arch = None
  if (config.value_norm or config.layer_scalar or config.per_layer_input_dim
      or config.num_kv_shared_layers):
    arch = GEMMA4 if is_gemma4(config) else None
  elif (config.attn_output_gate or config.token_mixers is not None
      or config.partial_rotary_factor != 1.0):
    arch = QWEN35 if _is_qwen35(config) else None
  elif (config.attention_sinks or config.router_bias or config.expert_bias
      or config.attn_out_bias or config.mlp_activation == "clamped_swiglu"):
    arch = GPT_OSS if _is_gpt_oss(config) else None
  elif config.num_experts and not llama_like:
    arch = None
  elif gemma_like and config.use_post_norms and config.qk_norm and not config.qkv_bias:
    arch = GEMMA3  # its sliding layers turn unscaled: they need their own base with scaling
    arch = arch if config.rope_local_theta or config.rope_scaling_factor is None else None
  elif gemma_like and config.use_post_norms and not any(qwen_only):
    arch = "Gemma2ForCausalLM"
  elif gemma_like and not any(gemma2_only + qwen_only) and config.sliding_window is None:
    arch = "GemmaForCausalLM" if config.rope_scaling_factor is None else None
  elif llama_like and config.rope_free_layers and not any(gemma2_only):
    arch = SMOLLM3 if not (any(qwen_only) or config.num_experts or config.sliding_window) else None
  elif llama_like and not any(gemma2_only):
    arch = _swiglu_architecture(config)
  if (config.rope_local_theta is not None and arch not in (GEMMA3, GEMMA4)
      or config.rope_scaling_type == "linear" and arch in (GPT_OSS, QWEN35)):
    arch = None  # no other family turns its sliding layers with a base of their own
  if arch is None:
    raise UserError(
        "this model config has no Hugging Face equivalent among "
        f"{', '.join(ARCHITECTURES)} (mlp_activation={config.mlp_activation!r}, "
        f"norm_scale_plus_one={config.norm_scale_plus_one}, scale_embeddings="
        f"{config.scale_embeddings}, use_post_norms={config.use_post_norms}, qkv_bias="
        f"{config.qkv_bias}, qk_norm={config.qk_norm}, sliding_window={config.sliding_window}, "
        f"num_experts={config.num_experts}, router={config.router!r}, attention_sinks="
        f"{config.attention_sinks}, router_bias={config.router_bias}, expert_bias="
        f"{config.expert_bias}, attn_out_bias={config.attn_out_bias}, rope_local_theta="
        f"{config.rope_local_theta}, rope_free_layers={config.rope_free_layers}, "
        f"local layers {[i for i, x in enumerate(config.local_layers()) if x]}); use a preset or "
        f"an imported checkpoint of one of these families as the base of the student")
  return arch


def _family_hf_fields(config: TransformerConfig, arch: str) -> dict[str, Any]:
  """The config.json keys one architecture adds to the shared ones."""
  window = config.sliding_window if any(config.local_layers()) else None
  if arch == GEMMA4:
    return gemma4_hf_fields(config)
  if arch == QWEN35:
    mixers = config.token_mixers or (FULL,) * config.num_layers
    return dict(hidden_act="silu", layer_types=list(mixers),
                rope_parameters={**_rope_to_hf(config),
                                 "partial_rotary_factor": config.partial_rotary_factor},
                linear_num_key_heads=config.linear_num_key_heads,
                linear_num_value_heads=config.linear_num_value_heads,
                linear_key_head_dim=config.linear_key_head_dim,
                linear_value_head_dim=config.linear_value_head_dim,
                linear_conv_kernel_dim=config.linear_conv_kernel)
  if arch == GPT_OSS:
    return dict(hidden_act="silu", attention_bias=config.qkv_bias, sliding_window=window,
                layer_types=[SLIDING if local else FULL for local in config.local_layers()],
                num_local_experts=config.num_experts,
                num_experts_per_tok=config.num_experts_per_tok,
                intermediate_size=config.expert_mlp_dim, swiglu_alpha=config.swiglu_alpha,
                swiglu_limit=config.swiglu_limit, router_aux_loss_coef=0.0)
  if arch in _GEMMA_FAMILY:
    fields = dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
    if arch in ("Gemma2ForCausalLM", GEMMA3):
      scalar = config.query_pre_attn_scalar or config.head_dim
      fields.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                    attn_logit_softcapping=config.attn_logit_softcap,
                    final_logit_softcapping=config.final_logit_softcap,
                    sliding_window=config.sliding_window or config.max_seq_len,
                    layer_types=[SLIDING if local else FULL for local in config.local_layers()])
    if arch == GEMMA3:  # one RoPE per layer type; the sliding layers' is unscaled
      local = {"rope_type": "default", "rope_theta": config.rope_local_theta or config.rope_theta}
      fields.update(rope_parameters={FULL: _rope_to_hf(config), SLIDING: local},
                    rope_local_base_freq=local["rope_theta"])
    return fields
  fields = dict(hidden_act="silu")
  if arch == "LlamaForCausalLM":
    fields.update(mlp_bias=False)
  elif arch == SMOLLM3:  # no_rope_layers: 1 = RoPE, 0 = none
    free = config.rope_free_layers or ()
    fields.update(mlp_bias=False, use_sliding_window=False, layer_types=[FULL] * config.num_layers,
                  no_rope_layers=[int(i not in free) for i in range(config.num_layers)],
                  **{k: v if v < config.vocab_size else None  # the class's ids, if they fit
                     for k, v in (("pad_token_id", 128_004), ("bos_token_id", 128_000),
                                  ("eos_token_id", 128_001))})
  elif arch in _MISTRAL_FAMILY:
    fields.update(sliding_window=window)
  else:  # Qwen: a window is on every layer (max_window_layers=0) or on none
    fields.update(use_sliding_window=window is not None, sliding_window=window,
                  max_window_layers=0 if window is not None else config.num_layers,
                  layer_types=[SLIDING if window else FULL] * config.num_layers)
  return fields


def _rope_to_hf(config: TransformerConfig) -> dict[str, Any]:
  if config.rope_scaling_factor is None:
    return {"rope_type": "default", "rope_theta": config.rope_theta}
  if config.rope_scaling_type == "linear":
    return {"rope_type": "linear", "rope_theta": config.rope_theta,
            "factor": config.rope_scaling_factor}
  if config.rope_scaling_type == "yarn":
    rope = {"rope_type": "yarn", "rope_theta": config.rope_theta,
            "factor": config.rope_scaling_factor,
            "original_max_position_embeddings": config.rope_original_max_len,
            "beta_fast": config.rope_yarn_beta_fast, "beta_slow": config.rope_yarn_beta_slow,
            "truncate": config.rope_yarn_truncate}
    if config.rope_attention_factor is not None:
      rope["attention_factor"] = config.rope_attention_factor
    return rope
  return {"rope_type": "llama3", "rope_theta": config.rope_theta,
          "factor": config.rope_scaling_factor, "low_freq_factor": config.rope_low_freq_factor,
          "high_freq_factor": config.rope_high_freq_factor,
          "original_max_position_embeddings": config.rope_original_max_len}


def config_to_hf(config: TransformerConfig) -> dict[str, Any]:
  arch = hf_architecture(config)
  rope = _rope_to_hf(config)
  hf: dict[str, Any] = {
      "architectures": [arch],
      "model_type": {v: k for k, v in _MODEL_TYPES.items()}[arch],
      "vocab_size": config.vocab_size, "hidden_size": config.embed_dim,
      "intermediate_size": config.mlp_dim, "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim, "max_position_embeddings": config.max_seq_len,
      "rms_norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
      "attention_dropout": 0.0, "rope_parameters": rope, "rope_theta": config.rope_theta,
      "dtype": config.param_dtype, "torch_dtype": config.param_dtype,
  }
  if arch != "Qwen2ForCausalLM":  # Qwen 2's q/k/v biases are fixed by the class, not a flag
    hf["attention_bias"] = False
  if config.rope_scaling_factor is not None:
    hf["rope_scaling"] = dict(rope)
  hf.update(_family_hf_fields(config, arch))
  hf.update(_moe_hf_fields(config, arch))
  return hf


def _moe_hf_fields(config: TransformerConfig, arch: str) -> dict[str, Any]:
  if arch == "MixtralForCausalLM":
    return dict(num_local_experts=config.num_experts,
                num_experts_per_tok=config.num_experts_per_tok,
                intermediate_size=config.expert_mlp_dim, router_jitter_noise=0.0)
  if arch != "Qwen3MoeForCausalLM":
    return {}
  return dict(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
              moe_intermediate_size=config.expert_mlp_dim, norm_topk_prob=config.norm_topk_prob,
              decoder_sparse_step=1, mlp_only_layers=[])
