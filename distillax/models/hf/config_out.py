"""TransformerConfig -> Hugging Face `config.json`: which architecture holds a config (the one
whose fixed parts it has, or a one-line refusal naming what none of them has) and its fields in
both the transformers 5 layout (`rope_parameters`) and the older one, so every reader agrees.
The other direction, and the family constants both share, are `config.py`."""

from __future__ import annotations

from typing import Any

from distillax.errors import UserError
from distillax.models.config import FULL, SLIDING, TransformerConfig
from distillax.models.hf.config import (ARCHITECTURES, GEMMA3, GEMMA_FAMILY, GPT_OSS,
                                        MISTRAL_FAMILY, MODEL_TYPES, QWEN35, QWEN35_MOE,
                                        SMOLLM3)
from distillax.models.hf.deepseek import (DEEPSEEK_V3, GLM4_MOE, family_architecture,
                                          family_hf_fields)
from distillax.models.hf.gemma4 import GEMMA4, gemma4_hf_fields, is_gemma4
from distillax.models.hf.llama4 import LLAMA4, is_llama4, llama4_hf_fields
from distillax.models.hf.olmo3 import OLMO3, is_olmo3, olmo3_hf_fields
from distillax.models.hf.phi3 import PHI3, is_phi3, longrope_to_hf, phi3_hf_fields
from distillax.models.hf.qwen3_next import (QWEN3_NEXT, holds_qwen3_next_experts,
                                            qwen3_next_hf_fields)


# The parts (of a mixture of experts, of RoPE) only some families have: the architectures that
# hold each.
FEATURE_ARCHS = {
    "shared_expert_mlp_dim": (QWEN35_MOE, QWEN3_NEXT, LLAMA4, DEEPSEEK_V3, GLM4_MOE),
    # layers with a dense MLP instead of experts
    "moe_layers": ("Qwen3MoeForCausalLM", QWEN3_NEXT, LLAMA4, DEEPSEEK_V3, GLM4_MOE),
    "routed_scaling_factor": (DEEPSEEK_V3, GLM4_MOE),
    "moe_scale_inputs": (LLAMA4,),
    "rope_yarn_mscale": (DEEPSEEK_V3,),  # with rope_yarn_mscale_all_dim
    "rope_interleaved": (DEEPSEEK_V3,),
}


def _family_parts(config: TransformerConfig) -> list[tuple[str, bool]]:
  """(field, whether the config uses it) for each field of FEATURE_ARCHS."""
  return [("shared_expert_mlp_dim", bool(config.shared_expert_mlp_dim)),
          ("moe_layers", config.moe_layers is not None),
          ("routed_scaling_factor", config.routed_scaling_factor != 1.0),
          ("moe_scale_inputs", config.moe_scale_inputs),
          ("rope_yarn_mscale", bool(config.rope_yarn_mscale or config.rope_yarn_mscale_all_dim)),
          ("rope_interleaved", config.rope_interleaved)]


def _qwen35_architecture(config: TransformerConfig) -> str | None:
  """Qwen3_5ForCausalLM, or Qwen3_5MoeForCausalLM with experts (softmax, top-k renormalised,
  beside a sigmoid-gated shared expert), for a config with their fixed parts (gated attention
  with q/k norms, (1 + w) norms, SwiGLU) and nothing of the other families; else None."""
  fixed = (config.attn_output_gate and config.qk_norm and config.norm_scale_plus_one
           and config.mlp_activation == "swiglu")
  others = (config.qkv_bias or config.scale_embeddings or config.use_post_norms
            or config.attn_logit_softcap or config.final_logit_softcap
            or config.query_pre_attn_scalar or config.sliding_window
            or config.rope_scaling_factor or config.attention_sinks or config.attn_out_bias
            or config.router_bias or config.expert_bias)
  if not fixed or others:
    return None
  if config.fused_qkvz_ba:  # Qwen3-Next's checkpoint layout
    return QWEN3_NEXT if holds_qwen3_next_experts(config) else None
  if not config.num_experts:
    return QWEN35
  moe = (config.router == "softmax_topk" and config.norm_topk_prob
         and config.shared_expert_mlp_dim and config.shared_expert_gate)
  return QWEN35_MOE if moe else None


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
  if not config.pre_norms or config.qk_norm_across_heads:  # OLMo's post-norm block
    arch = OLMO3 if is_olmo3(config) else None
  elif config.fused_qkv_gate_up or config.rope_scaling_type == "longrope":  # Phi-3/4
    arch = PHI3 if is_phi3(config) else None
  elif (config.moe_scale_inputs or config.qk_l2_norm or config.attention_chunk_size
        or config.attn_temperature_floor_scale):  # Llama 4
    arch = LLAMA4 if is_llama4(config) else None
  elif (config.value_norm or config.layer_scalar or config.per_layer_input_dim
      or config.num_kv_shared_layers or config.attention_k_eq_v or config.global_num_kv_heads):
    arch = GEMMA4 if is_gemma4(config) else None
  elif config.kv_lora_rank or config.router_score_bias:  # DeepSeek's attention or router
    arch = family_architecture(config)
  elif (config.attn_output_gate or config.token_mixers is not None
      or config.partial_rotary_factor != 1.0):
    arch = _qwen35_architecture(config)
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
  if (config.rope_local_theta is not None and arch not in (GEMMA3, GEMMA4, OLMO3)
      or config.rope_scaling_type == "linear" and arch in (GPT_OSS, QWEN35, QWEN35_MOE)
      or any(on and arch not in FEATURE_ARCHS[name] for name, on in _family_parts(config))):
    arch = None  # no other family turns its sliding layers with a base of their own, or has
    # this part
  if arch is None:
    _refuse(config)
  return arch


def _refuse(config: TransformerConfig) -> None:
  """The one-line refusal of a config no architecture holds, naming the fields that decide."""
  raise UserError(
      "this model config has no Hugging Face equivalent among "
      f"{', '.join(ARCHITECTURES)} (mlp_activation={config.mlp_activation!r}, "
      f"norm_scale_plus_one={config.norm_scale_plus_one}, scale_embeddings="
      f"{config.scale_embeddings}, use_post_norms={config.use_post_norms}, qkv_bias="
      f"{config.qkv_bias}, qk_norm={config.qk_norm}, sliding_window={config.sliding_window}, "
      f"num_experts={config.num_experts}, shared_expert_mlp_dim="
      f"{config.shared_expert_mlp_dim}, moe_layers={config.moe_layers}, router="
      f"{config.router!r}, routed_scaling_factor={config.routed_scaling_factor}, "
      f"router_score_bias={config.router_score_bias}, kv_lora_rank={config.kv_lora_rank}, "
      f"attention_sinks="
      f"{config.attention_sinks}, router_bias={config.router_bias}, expert_bias="
      f"{config.expert_bias}, attn_out_bias={config.attn_out_bias}, rope_local_theta="
      f"{config.rope_local_theta}, rope_free_layers={config.rope_free_layers}, pre_norms="
      f"{config.pre_norms}, fused_qkv_gate_up={config.fused_qkv_gate_up}, "
      f"rope_scaling_type={config.rope_scaling_type!r}, partial_rotary_factor="
      f"{config.partial_rotary_factor}, "
      f"local layers {[i for i, x in enumerate(config.local_layers()) if x]}); use a preset or "
      f"an imported checkpoint of one of these families as the base of the student")


def _family_hf_fields(config: TransformerConfig, arch: str) -> dict[str, Any]:
  """The config.json keys one architecture adds to the shared ones."""
  window = config.sliding_window if any(config.local_layers()) else None
  if arch == GEMMA4:
    return gemma4_hf_fields(config)
  if arch == OLMO3:
    return olmo3_hf_fields(config, _rope_to_hf)
  if arch == PHI3:
    return phi3_hf_fields(config, _rope_to_hf)
  if arch == LLAMA4:
    return llama4_hf_fields(config)
  if arch in (DEEPSEEK_V3, GLM4_MOE):
    return family_hf_fields(config, arch, _rope_to_hf(config))
  if arch in (QWEN35, QWEN35_MOE, QWEN3_NEXT):
    mixers = config.token_mixers or (FULL,) * config.num_layers
    moe = {} if arch == QWEN35 else dict(
        num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.expert_mlp_dim,
        shared_expert_intermediate_size=config.shared_expert_mlp_dim)
    if arch == QWEN3_NEXT:
      moe = qwen3_next_hf_fields(config)
    return dict(hidden_act="silu", **moe, layer_types=list(mixers),
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
  if arch in GEMMA_FAMILY:
    return _gemma_hf_fields(config, arch)
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
  elif arch in MISTRAL_FAMILY:
    fields.update(sliding_window=window)
  else:  # Qwen: a window is on every layer (max_window_layers=0) or on none
    fields.update(use_sliding_window=window is not None, sliding_window=window,
                  max_window_layers=0 if window is not None else config.num_layers,
                  layer_types=[SLIDING if window else FULL] * config.num_layers)
  return fields


def _gemma_hf_fields(config: TransformerConfig, arch: str) -> dict[str, Any]:
  """Gemma 1-3's keys: the tanh GELU; Gemma 2's and 3's query scalar, soft-caps and layer
  types; Gemma 3's RoPE per layer type."""
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


def _rope_to_hf(config: TransformerConfig) -> dict[str, Any]:
  if config.rope_scaling_factor is None:
    return {"rope_type": "default", "rope_theta": config.rope_theta}
  if config.rope_scaling_type == "longrope":
    return longrope_to_hf(config)
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
    if config.rope_yarn_mscale or config.rope_yarn_mscale_all_dim:  # DeepSeek's
      rope.update(mscale=config.rope_yarn_mscale, mscale_all_dim=config.rope_yarn_mscale_all_dim)
    return rope
  return {"rope_type": "llama3", "rope_theta": config.rope_theta,
          "factor": config.rope_scaling_factor, "low_freq_factor": config.rope_low_freq_factor,
          "high_freq_factor": config.rope_high_freq_factor,
          "original_max_position_embeddings": config.rope_original_max_len}


def rope_parameters(config: TransformerConfig) -> dict[str, Any]:
  """transformers' `rope_parameters` of a model whose layers all turn one RoPE (the EAGLE-3
  head's transformer_layer_config, models/hf/speculators.py)."""
  return _rope_to_hf(config)


def config_to_hf(config: TransformerConfig) -> dict[str, Any]:
  arch = hf_architecture(config)
  rope = _rope_to_hf(config)
  hf: dict[str, Any] = {
      "architectures": [arch],
      "model_type": {v: k for k, v in MODEL_TYPES.items()}[arch],
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
              decoder_sparse_step=1, mlp_only_layers=[
                  i for i in range(config.num_layers) if not config.layer_is_moe(i)])
