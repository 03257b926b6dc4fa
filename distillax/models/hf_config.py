"""Hugging Face `config.json` <-> TransformerConfig for Llama, Gemma and Gemma 2.

Reads both the transformers 5 layout (`rope_parameters`) and the older one (`rope_theta` +
`rope_scaling`), and writes both so other readers (older transformers, serving stacks) agree.
"""

from __future__ import annotations

from typing import Any, Mapping

from distillax.errors import UserError
from distillax.models.config import TransformerConfig

ARCHITECTURES = ("LlamaForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "gemma": "GemmaForCausalLM",
                "gemma2": "Gemma2ForCausalLM"}
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu")  # Gemma's 'gelu' means tanh


def architecture_of(hf: Mapping[str, Any], where: str) -> str:
  archs = hf.get("architectures") or []
  arch = archs[0] if archs else _MODEL_TYPES.get(hf.get("model_type", ""), "")
  if arch not in ARCHITECTURES:
    raise UserError(f"{where}: unsupported architecture {arch or hf.get('model_type')!r}; "
                    f"distillax imports {', '.join(ARCHITECTURES)}")
  return arch


def _rope(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
  params = dict(hf.get("rope_parameters") or {})
  legacy = dict(hf.get("rope_scaling") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
  rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
  scaling = params if params.get("rope_type") == "llama3" else legacy
  if rope_type == "default":
    return {"rope_theta": float(theta)}
  if rope_type == "llama3":
    return {"rope_theta": float(theta), "rope_scaling_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_len": int(scaling["original_max_position_embeddings"])}
  raise UserError(f"{where}: unsupported RoPE type {rope_type!r}; supported: default, llama3")


def _sliding(hf: Mapping[str, Any], num_layers: int, where: str) -> dict[str, Any]:
  window = hf.get("sliding_window")
  types = hf.get("layer_types") or [
      "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
  local = [t == "sliding_attention" for t in types]
  if window is None or not any(local):
    return {"sliding_window": None}
  pattern = 0 if all(local) else local.index(False) + 1
  expected = [pattern == 0 or (i + 1) % pattern != 0 for i in range(num_layers)]
  if local != expected:
    raise UserError(f"{where}: layer_types {types} is not a periodic local/global pattern that "
                    f"distillax supports (every p-th layer global)")
  return {"sliding_window": int(window), "sliding_window_pattern": pattern}


def config_from_hf(hf: Mapping[str, Any], *, where: str = "config.json",
                   dtype: str | None = None, **overrides) -> TransformerConfig:
  """The TransformerConfig of a HF config dict. `dtype` sets both param and compute dtype."""
  arch = architecture_of(hf, where)
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag):
      raise UserError(f"{where}: {flag}=true is not supported (distillax models have no biases)")
  heads = int(hf["num_attention_heads"])
  fields: dict[str, Any] = dict(
      vocab_size=int(hf["vocab_size"]), embed_dim=int(hf["hidden_size"]),
      num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
      mlp_dim=int(hf["intermediate_size"]), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      max_seq_len=int(hf.get("max_position_embeddings", 2048)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", arch != "LlamaForCausalLM")),
      **_rope(hf, where))
  act = hf.get("hidden_activation") or hf.get("hidden_act")
  if arch == "LlamaForCausalLM":
    if (act or "silu") != "silu":
      raise UserError(f"{where}: hidden_act={act!r} is not supported for Llama (only silu)")
    fields.update(mlp_activation="swiglu")
  else:
    if (act or "gelu_pytorch_tanh") not in _TANH_GELU:
      raise UserError(f"{where}: hidden activation {act!r} is not supported for Gemma "
                      f"(only gelu_pytorch_tanh)")
    fields.update(mlp_activation="geglu", norm_scale_plus_one=True, scale_embeddings=True)
  if arch == "Gemma2ForCausalLM":
    fields.update(use_post_norms=True, attn_logit_softcap=hf.get("attn_logit_softcapping"),
                  final_logit_softcap=hf.get("final_logit_softcapping"),
                  query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                  **_sliding(hf, fields["num_layers"], where))
  if dtype is not None:
    fields.update(param_dtype=str(dtype), dtype=str(dtype))
  fields.update(overrides)
  return TransformerConfig(**fields)


def hf_architecture(config: TransformerConfig) -> str:
  """Which HF class can hold this config, or a UserError naming the feature that none can."""
  gemma_like = (config.mlp_activation == "geglu" and config.norm_scale_plus_one
                and config.scale_embeddings)
  llama_like = (config.mlp_activation == "swiglu" and not config.norm_scale_plus_one
                and not config.scale_embeddings)
  gemma2_only = (config.use_post_norms, config.attn_logit_softcap, config.final_logit_softcap,
                 config.sliding_window, config.query_pre_attn_scalar)
  if gemma_like and config.use_post_norms:
    return "Gemma2ForCausalLM"
  if not any(gemma2_only) and llama_like:
    return "LlamaForCausalLM"
  if not any(gemma2_only) and gemma_like and config.rope_scaling_factor is None:
    return "GemmaForCausalLM"
  raise UserError(
      "this model config has no Hugging Face equivalent among "
      f"{', '.join(ARCHITECTURES)} (mlp_activation={config.mlp_activation!r}, "
      f"norm_scale_plus_one={config.norm_scale_plus_one}, scale_embeddings="
      f"{config.scale_embeddings}, use_post_norms={config.use_post_norms}); use a Llama or Gemma "
      f"preset as the base of the student")


def config_to_hf(config: TransformerConfig) -> dict[str, Any]:
  arch = hf_architecture(config)
  rope = {"rope_type": "default", "rope_theta": config.rope_theta}
  if config.rope_scaling_factor is not None:
    rope = {"rope_type": "llama3", "rope_theta": config.rope_theta,
            "factor": config.rope_scaling_factor, "low_freq_factor": config.rope_low_freq_factor,
            "high_freq_factor": config.rope_high_freq_factor,
            "original_max_position_embeddings": config.rope_original_max_len}
  hf: dict[str, Any] = {
      "architectures": [arch],
      "model_type": {v: k for k, v in _MODEL_TYPES.items()}[arch],
      "vocab_size": config.vocab_size, "hidden_size": config.embed_dim,
      "intermediate_size": config.mlp_dim, "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim, "max_position_embeddings": config.max_seq_len,
      "rms_norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
      "attention_bias": False, "attention_dropout": 0.0,
      "rope_parameters": rope, "rope_theta": config.rope_theta,
      "dtype": config.param_dtype, "torch_dtype": config.param_dtype,
  }
  if config.rope_scaling_factor is not None:
    hf["rope_scaling"] = dict(rope)
  if arch == "LlamaForCausalLM":
    hf.update(hidden_act="silu", mlp_bias=False)
  else:
    hf.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
  if arch == "Gemma2ForCausalLM":
    scalar = config.query_pre_attn_scalar or config.head_dim
    hf.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
              attn_logit_softcapping=config.attn_logit_softcap,
              final_logit_softcapping=config.final_logit_softcap,
              sliding_window=config.sliding_window or config.max_seq_len,
              layer_types=["sliding_attention" if config.layer_uses_sliding_window(i)
                           else "full_attention" for i in range(config.num_layers)])
  return hf
