"""Phi-3 and Phi-4 in Hugging Face `config.json` (Phi3Config, model_type phi3) <->
TransformerConfig.

Phi3ForCausalLM is Llama's block (SwiGLU, plain RMSNorms, no biases) stored with q, k and v as
one `qkv_proj` and gate and up as one `gate_up_proj` (model.fused_qkv_gate_up, read and written
by names.py), with partial RoPE (`partial_rotary_factor`: Phi-4-mini turns three quarters of
each head) and, in the long-context checkpoints, LongRoPE: a divisor per turning pair, the short
set while a forward's positions stay within original_max_position_embeddings, the long set past
it, and cos/sin scaled by the attention factor (sqrt(1 + ln(factor) / ln(original)) unless
given, the factor max_position_embeddings / original unless given). A sliding window, when one
is shorter than the context, applies to every layer, as transformers' Phi-3 masks it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from distillax.errors import UserError
from distillax.models.config import TransformerConfig, window_fields

PHI3 = "Phi3ForCausalLM"
LONGROPE_TYPES = ("longrope", "su")  # 'su': the older configs' name for it


def longrope_fields(scaling: Mapping[str, Any], theta: float, hf: Mapping[str, Any],
                    where: str) -> dict[str, Any]:
  """LongRoPE's fields from a rope_parameters / rope_scaling dict (original context and the
  divisor lists there or, in older configs, original_max_position_embeddings at the top)."""
  original = (scaling.get("original_max_position_embeddings")
              or hf.get("original_max_position_embeddings"))
  short, long = scaling.get("short_factor"), scaling.get("long_factor")
  if original is None or short is None or long is None:
    raise UserError(f"{where}: longrope RoPE needs 'short_factor', 'long_factor' and "
                    f"'original_max_position_embeddings'; fix the config.json")
  factor = scaling.get("factor") or hf.get("max_position_embeddings", 4096) / original
  attention = scaling.get("attention_factor")
  return dict(rope_theta=float(theta), rope_scaling_type="longrope",
              rope_scaling_factor=float(factor), rope_original_max_len=int(original),
              rope_short_factors=tuple(float(x) for x in short),
              rope_long_factors=tuple(float(x) for x in long),
              rope_attention_factor=None if attention is None else float(attention))


def longrope_to_hf(config: TransformerConfig) -> dict[str, Any]:
  rope = {"rope_type": "longrope", "rope_theta": config.rope_theta,
          "factor": config.rope_scaling_factor,
          "original_max_position_embeddings": config.rope_original_max_len,
          "short_factor": list(config.rope_short_factors),
          "long_factor": list(config.rope_long_factors)}
  if config.rope_attention_factor is not None:
    rope["attention_factor"] = config.rope_attention_factor
  return rope


def phi3_fields(hf: Mapping[str, Any], num_layers: int, where: str) -> dict[str, Any]:
  """The TransformerConfig switches of a Phi3ForCausalLM config.json (RoPE itself is read by
  hf/config.py's reader, LongRoPE by `longrope_fields`)."""
  act = hf.get("hidden_act") or "silu"
  if act != "silu":
    raise UserError(f"{where}: hidden_act={act!r} is not supported for {PHI3} (only silu)")
  rope = dict(hf.get("rope_parameters") or {})
  partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
  window = hf.get("sliding_window")
  if window is not None and window >= hf.get("max_position_embeddings", 4096):
    window = None  # no sequence reaches it: full attention (Phi-4-mini's 262,144)
  return dict(mlp_activation="swiglu", fused_qkv_gate_up=True, partial_rotary_factor=partial,
              **window_fields(window, [True] * num_layers))


def is_phi3(config: TransformerConfig) -> bool:
  """Whether Phi3ForCausalLM holds the config: a Llama block stored fused, its sliding window
  (if any) on every layer, its RoPE plain or LongRoPE, nothing of the other families."""
  local = config.local_layers()
  return (config.fused_qkv_gate_up and config.mlp_activation == "swiglu"
          and config.pre_norms and (all(local) or not any(local))
          and (config.rope_scaling_factor is None or config.rope_scaling_type == "longrope")
          and not (config.norm_scale_plus_one or config.scale_embeddings or config.qkv_bias
                   or config.qk_norm or config.attn_out_bias or config.attention_sinks
                   or config.use_post_norms or config.attn_logit_softcap
                   or config.final_logit_softcap or config.query_pre_attn_scalar
                   or config.num_experts or config.token_mixers is not None
                   or config.attn_output_gate or config.rope_free_layers
                   or config.rope_local_theta is not None or config.value_norm
                   or config.layer_scalar or config.per_layer_input_dim
                   or config.num_kv_shared_layers or config.attention_k_eq_v
                   or config.global_head_dim or config.global_num_kv_heads))


def phi3_hf_fields(config: TransformerConfig,
                   rope_to_hf: Callable[[TransformerConfig], dict]) -> dict[str, Any]:
  """The config.json keys Phi-3 adds to the shared ones. The partial rotary factor goes both in
  rope_parameters and at the top, where Phi3Config takes it from when rope_scaling replaces
  rope_parameters; token ids are left to the tokenizer's files (Phi3Config's defaults lie
  outside small vocabularies)."""
  longrope = config.rope_scaling_factor is not None
  window = config.sliding_window if any(config.local_layers()) else None
  return dict(hidden_act="silu", sliding_window=window, resid_pdrop=0.0, embd_pdrop=0.0,
              partial_rotary_factor=config.partial_rotary_factor,
              original_max_position_embeddings=(config.rope_original_max_len if longrope
                                                else config.max_seq_len),
              rope_parameters={**rope_to_hf(config),
                               "partial_rotary_factor": config.partial_rotary_factor},
              pad_token_id=None, bos_token_id=None, eos_token_id=None)
