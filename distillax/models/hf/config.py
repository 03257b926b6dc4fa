"""Hugging Face `config.json` -> TransformerConfig for Llama, Gemma, Gemma 2, Gemma 3, Qwen
2/2.5, Qwen 3, Mistral, SmolLM3, OLMo 3 (hf/olmo3.py), Phi-3/4 (hf/phi3.py), and the mixtures of
experts Qwen3-MoE (with its dense layers), Mixtral, gpt-oss, Qwen3.5-MoE, Qwen3-Next
(hf/qwen3_next.py), Llama 4 (hf/llama4.py), DeepSeek V3 and GLM-4.5 (hf/deepseek.py).

Reads both the transformers 5 layout (`rope_parameters`) and the older one (`rope_theta` +
`rope_scaling`), and writes both so other readers (older transformers, serving stacks) agree.
The families differ only in a few switches: Gemma's GeGLU / (1 + w) norms / sqrt(D) embeddings,
Gemma 2's post norms, soft-caps and alternating sliding window, Qwen 2's q/k/v biases, Qwen 3's
q/k RMSNorm, Mistral's sliding window on every layer; Qwen3-MoE is Qwen 3 with experts in every
layer (softmax then top-k, `norm_topk_prob`), Mixtral is Mistral with experts (top-k then
softmax). gpt-oss adds biases (q/k/v/o, router, experts), attention sinks, the clamped SwiGLU,
YaRN RoPE and alternating sliding / full layers. Qwen3.5's dense text decoder mixes Gated
DeltaNet and gated full-attention layers by `layer_types`, with partial RoPE; Qwen3.5-MoE adds
experts to every layer beside a sigmoid-gated shared expert. Gemma 3 is Gemma
2 with q/k norms, five sliding layers in six and a RoPE per layer type (`rope_parameters` keyed
by layer type: the sliding layers' base, the global layers' with linear scaling); SmolLM3 is
Llama with no RoPE where `no_rope_layers` says 0. Per-layer `layer_types` that follow no pattern
(a Gemma 2 student made of teacher blocks) are read and, for Gemma 2 and gpt-oss, written as they
are. Writing a config.json is `config_out.py`.
"""

from __future__ import annotations

from typing import Any, Mapping

from distillax.errors import UserError
from distillax.models.config import FULL, LINEAR, SLIDING, TransformerConfig, window_fields
from distillax.models.hf.deepseek import (DEEPSEEK_V3, GLM4_MOE, deepseek_fields,
                                          glm4_moe_fields, yarn_mscales)
from distillax.models.hf.gemma4 import GEMMA4, gemma4_fields
from distillax.models.hf.llama4 import LLAMA4, llama4_fields
from distillax.models.hf.olmo3 import OLMO3, olmo3_fields
from distillax.models.hf.phi3 import LONGROPE_TYPES, PHI3, longrope_fields, phi3_fields
from distillax.models.hf.qwen3_next import QWEN3_NEXT, qwen3_next_moe_fields

MODEL_TYPES = {"llama": "LlamaForCausalLM", "gemma": "GemmaForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "gpt_oss": "GptOssForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                "gemma4_text": "Gemma4ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                "olmo3": OLMO3, "phi3": PHI3, "qwen3_next": QWEN3_NEXT, "llama4_text": LLAMA4,
                "deepseek_v3": DEEPSEEK_V3, "glm4_moe": GLM4_MOE}
GPT_OSS = "GptOssForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
SMOLLM3 = "SmolLM3ForCausalLM"
QWEN35 = "Qwen3_5ForCausalLM"
QWEN35_MOE = "Qwen3_5MoeForCausalLM"
# Multimodal wrappers whose text decoder distillax reads (text_config; weights under a prefix).
MULTIMODAL = {"Gemma4ForConditionalGeneration": GEMMA4,
              "Gemma3ForConditionalGeneration": GEMMA3,
              "Qwen3_5ForConditionalGeneration": QWEN35,
              "Qwen3_5MoeForConditionalGeneration": QWEN35_MOE,
              "Llama4ForConditionalGeneration": LLAMA4}
ARCHITECTURES = tuple(MODEL_TYPES.values())
GEMMA_FAMILY = ("GemmaForCausalLM", "Gemma2ForCausalLM", GEMMA3)
_QWEN_FAMILY = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MISTRAL_FAMILY = ("MistralForCausalLM", "MixtralForCausalLM")
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu")  # Gemma's 'gelu' means tanh


def supported_architectures() -> str:
  """'LlamaForCausalLM (llama), ...': what an error about an unsupported model names."""
  return ", ".join(f"{arch} ({model_type})" for model_type, arch in MODEL_TYPES.items())


def text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
  """The text decoder's config of a multimodal wrapper's config.json (the config as is
  otherwise), with the wrapper's text architecture named. Whether the head is tied is the
  wrapper's own tie_word_embeddings when it has one: transformers ties the wrapper's lm_head by
  it (a tied Qwen3.5 wrapper saved by transformers 5.24 says true there, false in text_config)."""
  archs = hf.get("architectures") or []
  if archs and archs[0] in MULTIMODAL and isinstance(hf.get("text_config"), Mapping):
    tie = {k: hf[k] for k in ("tie_word_embeddings",) if k in hf}
    return {**hf["text_config"], "architectures": [MULTIMODAL[archs[0]]], **tie}
  return hf


def architecture_of(hf: Mapping[str, Any], where: str) -> str:
  """The HF class of a config dict (`architectures[0]`, else from `model_type`), if supported."""
  hf = text_config(hf)
  archs = hf.get("architectures") or []
  model_type = hf.get("model_type")
  arch = archs[0] if archs else MODEL_TYPES.get(str(model_type), "")
  if arch not in ARCHITECTURES:
    named = repr(arch or model_type)
    if arch and model_type:
      named += f" (model_type {model_type!r})"
    raise UserError(f"{where}: unsupported architecture {named}; distillax imports "
                    f"{supported_architectures()}")
  return arch


def _rope(hf: Mapping[str, Any], where: str, arch: str | None = None) -> dict[str, Any]:
  params = dict(hf.get("rope_parameters") or {})
  legacy = dict(hf.get("rope_scaling") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
  rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
  scaling = (params if params.get("rope_type") in ("llama3", "yarn", "linear") + LONGROPE_TYPES
             else legacy)
  if rope_type == "default":
    return {"rope_theta": float(theta)}
  if rope_type in LONGROPE_TYPES or rope_type == "yarn" and "long_factor" in scaling:
    return longrope_fields(scaling, float(theta), hf, where)  # Phi3Config reads yarn so too
  if rope_type == "yarn":
    return {**_yarn(scaling, float(theta), where), **yarn_mscales(scaling, arch, where)}
  if rope_type == "linear":
    return {"rope_theta": float(theta), "rope_scaling_type": "linear",
            "rope_scaling_factor": float(scaling["factor"])}
  if rope_type == "llama3":
    return {"rope_theta": float(theta), "rope_scaling_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_len": int(scaling["original_max_position_embeddings"])}
  raise UserError(f"{where}: unsupported RoPE type {rope_type!r}; supported: default, llama3, "
                  f"yarn, linear, longrope")


def _yarn(scaling: Mapping[str, Any], theta: float, where: str) -> dict[str, Any]:
  """YaRN as transformers 5.24 computes it (beta 32/1 and truncate on by default; DeepSeek's
  mscale / mscale_all_dim: deepseek.yarn_mscales)."""
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
  if arch in MISTRAL_FAMILY:  # every layer (transformers ignores Mistral layer_types)
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


def _qwen35_moe_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Qwen3.5-MoE: Qwen3.5 with experts in every layer (softmax, top-k renormalised: the class
  fixes norm_topk_prob) beside a shared expert whose output a sigmoid gate scales."""
  return dict(num_experts=int(hf.get("num_experts", 256)),
              num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
              moe_mlp_dim=int(hf.get("moe_intermediate_size", 512)), router="softmax_topk",
              norm_topk_prob=True,
              shared_expert_mlp_dim=int(hf.get("shared_expert_intermediate_size", 512)),
              shared_expert_gate=True)


def _moe_fields(hf: Mapping[str, Any], arch: str, num_layers: int,
                where: str) -> dict[str, Any]:
  """The expert fields of Qwen3-MoE and Mixtral."""
  if arch == "MixtralForCausalLM":
    return dict(num_experts=int(hf["num_local_experts"]),
                num_experts_per_tok=int(hf["num_experts_per_tok"]), router="topk_softmax")
  if arch != "Qwen3MoeForCausalLM":
    return {}
  return dict(num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
              num_experts_per_tok=int(hf["num_experts_per_tok"]),
              moe_mlp_dim=int(hf["moe_intermediate_size"]), router="softmax_topk",
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
              moe_layers=_qwen3_moe_layers(hf, num_layers, where))


def _qwen3_moe_layers(hf: Mapping[str, Any], num_layers: int, where: str) -> tuple[int, ...]:
  """Qwen3-MoE's layers with experts as its transformers code picks them: every
  decoder_sparse_step-th layer not in mlp_only_layers (the others: a dense MLP of
  intermediate_size)."""
  step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
  step = 1 if step is None else step
  if (not isinstance(step, int) or isinstance(step, bool) or step < 1
      or not isinstance(dense, (list, tuple)) or any(not isinstance(i, int) for i in dense)):
    raise UserError(f"{where}: decoder_sparse_step={step!r}, mlp_only_layers={dense!r} must be "
                    f"a positive integer and a list of layer indices")
  return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def _family_fields(hf: Mapping[str, Any], arch: str, num_layers: int,
                   where: str) -> dict[str, Any]:
  """The TransformerConfig switches of one architecture."""
  act = hf.get("hidden_activation") or hf.get("hidden_act")
  if arch == GPT_OSS:  # its experts' activation is fixed by the class (hidden_act is unused)
    return _gpt_oss_fields(hf, num_layers, where)
  if arch in (QWEN35, QWEN35_MOE, QWEN3_NEXT):
    fields = _qwen35_fields(hf, act, num_layers, where)
    if arch == QWEN3_NEXT:  # Qwen3.5's layers stored otherwise, with Qwen3-MoE's dense layers
      return {**fields, **qwen3_next_moe_fields(hf, _qwen3_moe_layers(hf, num_layers, where))}
    return {**fields, **(_qwen35_moe_fields(hf) if arch == QWEN35_MOE else {})}
  if arch == OLMO3:
    return olmo3_fields(hf, num_layers, where, _rope)
  if arch == PHI3:
    return phi3_fields(hf, num_layers, where)
  if arch == LLAMA4:
    return llama4_fields(hf, num_layers, where)
  if arch in (DEEPSEEK_V3, GLM4_MOE):
    if (act or "silu") != "silu":
      raise UserError(f"{where}: hidden_act={act!r} is not supported for {arch} (only silu)")
    read = deepseek_fields if arch == DEEPSEEK_V3 else glm4_moe_fields
    return read(hf, num_layers, where)
  if arch == GEMMA4:
    if (act or "gelu_pytorch_tanh") not in _TANH_GELU:
      raise UserError(f"{where}: hidden activation {act!r} is not supported for {arch} "
                      f"(only gelu_pytorch_tanh)")
    return gemma4_fields(hf, num_layers, where)
  if arch not in GEMMA_FAMILY:
    if (act or "silu") != "silu":
      raise UserError(f"{where}: hidden_act={act!r} is not supported for {arch} (only silu)")
    fields: dict[str, Any] = dict(mlp_activation="swiglu", qkv_bias=arch == "Qwen2ForCausalLM",
                                  qk_norm=arch in _QK_NORM)
    if arch in _QWEN_FAMILY or arch in MISTRAL_FAMILY:
      fields.update(_sliding(hf, arch, num_layers, where))
    if arch == SMOLLM3:
      fields.update(_smollm3_fields(hf, num_layers, where))
    fields.update(_moe_fields(hf, arch, num_layers, where))
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
    if hf.get(flag) and arch != GPT_OSS and (arch, flag) != (GLM4_MOE, "attention_bias"):
      raise UserError(f"{where}: {flag}=true is not supported (distillax has biases only on "
                      f"the q/k/v projections of Qwen2ForCausalLM and {GLM4_MOE})")
  heads = int(hf["num_attention_heads"])
  fields: dict[str, Any] = dict(
      vocab_size=int(hf["vocab_size"]), embed_dim=int(hf["hidden_size"]),
      num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
      # Qwen3.5-MoE has no dense MLP width (mlp_dim is then unused)
      mlp_dim=int(hf.get("intermediate_size") or hf["moe_intermediate_size"]), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      max_seq_len=int(hf.get("max_position_embeddings", 2048)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", arch in GEMMA_FAMILY + (GEMMA4,))),
      **_rope(hf, where, arch))
  fields.update(_family_fields(hf, arch, fields["num_layers"], where))
  if dtype is not None:
    fields.update(param_dtype=str(dtype), dtype=str(dtype))
  fields.update(overrides)
  return TransformerConfig(**fields)
