"""Where our parameters go in a GGUF file: llama.cpp's tensor names and its `{arch}.*` keys.

A mixture of experts (Qwen3-MoE as llama.cpp's qwen3moe, Mixtral as its llama) stores each
layer's router as `ffn_gate_inp` [expert, embed] and its experts stacked, one 3-D tensor per
projection: `ffn_gate_exps` / `ffn_up_exps` [expert, expert_ff, embed] and `ffn_down_exps`
[expert, embed, expert_ff] (row-major; GGUF ne0 = the contracted axis, ggml's blocks run along
it), with expert_count, expert_used_count and expert_feed_forward_length. llama.cpp sizes a
llama-arch expert by feed_forward_length, so an MoE writes the expert width there too. Gemma 4's
MoE block (gemma4) stores gate and up as one `ffn_gate_up_exps` [expert, 2 x expert_ff, embed]
(gate rows first, made by gguf_gemma4_qwen35.gemma4_moe_tensors), the router's input scale as
`ffn_gate_inp.scale`, the per-expert scales as `ffn_down_exps.scale`, the dense MLP beside the
experts as the plain ffn_* tensors (feed_forward_length is its width) and the branches' norms as
post_ffw_norm_1, pre_ffw_norm_2 and post_ffw_norm_2.
"""

from __future__ import annotations

import math

import numpy as np

from distillax.edge.gemma4_qwen35 import (QWEN35_ARCHS, add_gemma4_hparams,
                                                add_qwen35_hparams)
from distillax.edge.arch_hooks import HOOKS
from distillax.models.config import TransformerConfig
from distillax.quant.config import GGML_WEIGHT_QTYPES

FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}  # gguf.LlamaFileType
_TOP_NAMES = {"embedder/embedding": "token_embd.weight", "final_norm/scale": "output_norm.weight",
              "lm_head": "output.weight",
              # Gemma 4's per-layer inputs: the second table, the embeddings' projection, its norm
              "per_layer_inputs/embedding": "per_layer_token_embd.weight",
              "per_layer_inputs/projection": "per_layer_model_proj.weight",
              "per_layer_inputs/norm/scale": "per_layer_proj_norm.weight"}
_BLOCK_NAMES = {
    "attn_norm/scale": "attn_norm.weight", "attn/q": "attn_q.weight", "attn/k": "attn_k.weight",
    "attn/v": "attn_v.weight", "attn/o": "attn_output.weight", "attn/q_bias": "attn_q.bias",
    "attn/k_bias": "attn_k.bias", "attn/v_bias": "attn_v.bias",
    "attn/q_norm/scale": "attn_q_norm.weight", "attn/k_norm/scale": "attn_k_norm.weight",
    "post_attn_norm/scale": "post_attention_norm.weight", "mlp_norm/scale": "ffn_norm.weight",
    "mlp/gate": "ffn_gate.weight", "mlp/up": "ffn_up.weight", "mlp/down": "ffn_down.weight",
    "post_mlp_norm/scale": "post_ffw_norm.weight",
    # Gemma 4: each block's gate and projection of its per-layer input, their norm, its scalar.
    "per_layer/gate": "inp_gate.weight", "per_layer/projection": "proj.weight",
    "per_layer/norm/scale": "post_norm.weight", "scalar": "layer_output_scale.weight",
}
_EXPERT_NAMES = {"mlp/router": "ffn_gate_inp.weight", "mlp/gate": "ffn_gate_exps.weight",
                 "mlp/up": "ffn_up_exps.weight", "mlp/down": "ffn_down_exps.weight"}
# gpt-oss: its pre-MLP norm is llama.cpp's attn_post_norm; sinks, o, router and expert biases.
_GPT_OSS_NAMES = {"mlp_norm/scale": "post_attention_norm.weight", "attn/sinks": "attn_sinks.weight",
                  "attn/o_bias": "attn_output.bias", "mlp/router_bias": "ffn_gate_inp.bias",
                  "mlp/gate_bias": "ffn_gate_exps.bias", "mlp/up_bias": "ffn_up_exps.bias",
                  "mlp/down_bias": "ffn_down_exps.bias"}
# Gemma 4's MoE block (models/moe/gemma4.py); mlp/gate_up: its experts' gate and up as one.
_GEMMA4_MOE_NAMES = {"mlp/router_scale": "ffn_gate_inp.scale",
                     "mlp/expert_scale": "ffn_down_exps.scale",
                     "mlp/gate_up": "ffn_gate_up_exps.weight",
                     "mlp/dense/gate": "ffn_gate.weight", "mlp/dense/up": "ffn_up.weight",
                     "mlp/dense/down": "ffn_down.weight",
                     "mlp/dense_post_norm/scale": "post_ffw_norm_1.weight",
                     "mlp/experts_pre_norm/scale": "pre_ffw_norm_2.weight",
                     "mlp/experts_post_norm/scale": "post_ffw_norm_2.weight"}
# Qwen3.5: the pre-MLP norm is llama.cpp's post_attention_norm; a Gated DeltaNet layer's tensors
# (attn/qkv: its q, k and v as one, made by gguf_gemma4_qwen35.qwen35_tensors).
_QWEN35_NAMES = {"mlp_norm/scale": "post_attention_norm.weight",
                 # Qwen3.5-MoE's shared expert (models/moe/shared.py) and its output gate
                 "mlp/shared_expert/gate": "ffn_gate_shexp.weight",
                 "mlp/shared_expert/up": "ffn_up_shexp.weight",
                 "mlp/shared_expert/down": "ffn_down_shexp.weight",
                 "mlp/shared_expert/output_gate": "ffn_gate_inp_shexp.weight"}
_LINEAR_NAMES = {"attn/qkv": "attn_qkv.weight", "attn/z": "attn_gate.weight",
                 "attn/b": "ssm_beta.weight", "attn/a": "ssm_alpha.weight",
                 "attn/conv": "ssm_conv1d.weight", "attn/dt_bias": "ssm_dt.bias",
                 "attn/A_log": "ssm_a", "attn/norm_scale": "ssm_norm.weight",
                 "attn/o": "ssm_out.weight"}


def gguf_name(param: str, config: TransformerConfig, arch: str) -> str:
  """llama.cpp's name of one of our parameters ('layers/3/attn/q' -> 'blk.3.attn_q.weight';
  an MoE's 'layers/3/mlp/gate' -> 'blk.3.ffn_gate_exps.weight')."""
  if param in _TOP_NAMES:
    return _TOP_NAMES[param]
  _, layer, rest = param.split("/", 2)
  names = ({**_BLOCK_NAMES, **_EXPERT_NAMES} if config.layer_is_moe(int(layer))
           else _BLOCK_NAMES)
  if arch == "gpt-oss":
    names = {**names, **_GPT_OSS_NAMES}
  if config.moe_dense_mlp:
    names = {**names, **_GEMMA4_MOE_NAMES}
  if arch in QWEN35_ARCHS:
    names = {**names, **_QWEN35_NAMES, **(_LINEAR_NAMES if config.layer_is_linear(int(layer))
                                          else {})}
  if arch in HOOKS:  # olmo2, phi3, qwen3next, llama4, deepseek2, glm4moe
    names = {**names, **HOOKS[arch].names(config, int(layer))}
  return f"blk.{layer}.{names[rest]}"


def add_hparams(writer, config: TransformerConfig, arch: str, quant: str) -> None:
  writer.add_context_length(config.max_seq_len)
  writer.add_embedding_length(config.embed_dim)
  writer.add_block_count(config.num_layers)
  hooks = HOOKS.get(arch)
  dense = hooks is not None and hooks.dense_ffn_length  # llama4, deepseek2: dense layers' width
  writer.add_feed_forward_length(config.mlp_dim if dense else _feed_forward_length(config))
  writer.add_head_count(config.num_heads)
  kv_heads = [config.layer_num_kv_heads(i) for i in range(config.num_layers)]
  kv_heads = kv_heads if len(set(kv_heads)) > 1 else config.num_kv_heads
  # Gemma 4: the full layers' (the sliding ones' are gemma4's *_swa keys); Qwen3.5 and GLM-4.5:
  # their partial RoPE turns rotary_dim features; DeepSeek: the absorbed attention's one head.
  head_dim = (config.global_head_dim or config.head_dim) if arch == "gemma4" else config.head_dim
  key_length = value_length = head_dim
  if hooks is not None and hooks.attention_lengths is not None:  # deepseek2's absorbed heads
    kv_heads, key_length, value_length = hooks.attention_lengths(config)
  writer.add_head_count_kv(kv_heads)
  writer.add_key_length(key_length)
  writer.add_value_length(value_length)
  partial = arch in QWEN35_ARCHS or hooks is not None and hooks.partial_rope
  writer.add_rope_dimension_count(config.rotary_dim if partial else head_dim)
  writer.add_rope_freq_base(float(config.rope_theta))
  writer.add_layer_norm_rms_eps(float(config.norm_eps))
  writer.add_vocab_size(config.vocab_size)
  writer.add_file_type(FILE_TYPES[quant])
  if config.num_experts:
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.expert_mlp_dim)
  if quant in GGML_WEIGHT_QTYPES:
    writer.add_quantization_version(2)  # ggml's GGML_QNT_VERSION
  if arch == "gpt-oss":
    _add_gpt_oss_hparams(writer, config)
  if arch == "gemma3":
    _add_gemma3_hparams(writer, config)
  if arch == "gemma4":
    add_gemma4_hparams(writer, config)
  if arch in QWEN35_ARCHS:
    add_qwen35_hparams(writer, config)
  if hooks is not None:
    hooks.hparams(writer, config)
  if arch == "gpt-oss" or hooks is not None and hooks.rope_scaling == "yarn":
    _add_yarn_hparams(writer, config)
  if arch == "gemma2":
    writer.add_attn_logit_softcapping(float(config.attn_logit_softcap))
    writer.add_final_logit_softcapping(float(config.final_logit_softcap))
    writer.add_sliding_window(int(config.sliding_window or config.max_seq_len))
    writer.add_sliding_window_pattern(2)  # what llama.cpp's gemma2 runs (it reads no pattern)


def _feed_forward_length(config: TransformerConfig) -> int | list[int]:
  """The MLP width: an MoE's expert width; one per layer when they differ (Gemma 4)."""
  if config.num_experts and not config.moe_dense_mlp:  # Gemma 4's: its dense MLP's
    return config.expert_mlp_dim
  widths = [config.layer_mlp_dim(i) for i in range(config.num_layers)]
  return widths if len(set(widths)) > 1 else config.mlp_dim


def _add_gemma3_hparams(writer, config: TransformerConfig) -> None:
  """The window of the sliding layers (llama.cpp slides five in six, their RoPE at 10k), the
  global layers' linear RoPE scaling and the final soft-cap, when the model has them."""
  if any(config.local_layers()):
    writer.add_sliding_window(int(config.sliding_window))
  if config.final_logit_softcap is not None:
    writer.add_final_logit_softcapping(float(config.final_logit_softcap))
  if config.rope_scaling_factor is not None:
    import gguf  # the edge extra; write_gguf checked it is installed
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(float(config.rope_scaling_factor))


def _add_gpt_oss_hparams(writer, config: TransformerConfig) -> None:
  """The sliding window (llama.cpp's gpt-oss slides on the even layers)."""
  writer.add_sliding_window(int(config.sliding_window or config.max_seq_len))


def _add_yarn_hparams(writer, config: TransformerConfig) -> None:
  """YaRN (gpt-oss, and the HOOKS archs that read it: olmo2, deepseek2): llama.cpp derives the
  attention factor 0.1 ln(factor) + 1 and the ramp from these keys."""
  if config.rope_scaling_factor is not None:
    import gguf  # the edge extra; write_gguf checked it is installed
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(config.rope_scaling_factor))
    writer.add_rope_scaling_orig_ctx_len(int(config.rope_original_max_len))
    writer.add_rope_scaling_yarn_beta_fast(float(config.rope_yarn_beta_fast))
    writer.add_rope_scaling_yarn_beta_slow(float(config.rope_yarn_beta_slow))


def rope_freq_factors(config: TransformerConfig) -> np.ndarray:
  """Llama 3.1's RoPE scaling as llama.cpp takes it: one divisor per frequency (rope_freqs),
  computed as convert_hf_to_gguf.py does."""
  dim, factor = config.head_dim, config.rope_scaling_factor
  low, high, old = (config.rope_low_freq_factor, config.rope_high_freq_factor,
                    config.rope_original_max_len)
  out = []
  for i in range(0, dim, 2):
    wavelen = 2 * math.pi * config.rope_theta ** (i / dim)
    if wavelen < old / high:
      out.append(1.0)
    elif wavelen > old / low:
      out.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)
