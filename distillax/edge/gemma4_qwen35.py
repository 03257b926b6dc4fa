"""What llama.cpp's gemma4 and qwen35 architectures read beyond one GGUF tensor per parameter:
their refusals, their `{arch}.*` keys and the tensors they store differently from distillax.

Gemma 4 (gemma4). Per-layer keys: sliding_window_pattern (one bool per layer), the full layers'
key/value length and RoPE dims (global_head_dim) with `*_swa` ones for the sliding layers, one
feed_forward_length per layer when the sharing layers' MLPs are double wide, one head_count_kv
per layer with global_num_kv_heads; full layers whose keys are their values (attention_k_eq_v)
have no attn_v, which llama.cpp reads as exactly that. The full layers' proportional RoPE is
ggml's ordinary RoPE over global_head_dim with `rope_freqs` factors: 1 for the pairs that turn,
1e30 for those that stand still (ggml divides a pair's frequency by its factor), as
convert_hf_to_gguf.py writes them. Norms are stored as they are (Gemma 4's are
plain), the layer scalar as `layer_output_scale`. llama.cpp fixes in code which earlier layer a
key/value-sharing layer reads: the last unshared layer for a full one, the one before it for a
sliding one (n_layer_kv_from_start - 1 or - 2); distillax's choice (the last unshared layer of
the same type) must agree, or the export is refused. The MoE block's experts store gate and up
as one ffn_gate_up_exps, gate rows first (`gemma4_moe_tensors`).

Qwen3.5 (qwen35). A full-attention layer's queries and output gate are one projection (attn_q,
per head [query rows, gate rows]). A Gated DeltaNet layer stores q, k and v as one attn_qkv (the
conv's channel order), z as attn_gate, b / a as ssm_beta / ssm_alpha, the conv as ssm_conv1d
[channels, taps], dt_bias as ssm_dt.bias, A = -exp(A_log) as ssm_a, the gated norm's scale as
ssm_norm and o as ssm_out. Value heads are stored in llama.cpp's tiled order: ggml repeats the
key heads [k0, k1, k0, k1, ...] where distillax (and Hugging Face) give value head h key head
h // (Hv / Hk), so every value-head axis is permuted (h = kh * r + j -> j * Hk + kh), as the
converter's V-head reorder does; a q8_0 / q4_0 ssm_out whose heads do not fill whole blocks of 32
is refused, as that reorder would regroup its blocks. Which layers are linear: the
attention.recurrent_layers flags. Positions turn by interleaved M-RoPE, every section fed the one
text position; the sections are split so that every turning pair reads one of them.

Qwen3.5-MoE (qwen35moe) is qwen35 with stacked experts in every layer (gguf_layout's ffn_*_exps)
beside the shared expert: ffn_gate_shexp / ffn_up_shexp / ffn_down_shexp, its output gate as the
vector ffn_gate_inp_shexp [embed] (always f32, as the router), its width in
expert_shared_feed_forward_length.
"""

from __future__ import annotations

import numpy as np

from distillax.errors import UserError
from distillax.models.config import TransformerConfig

STILL = 1e30  # a rope_freqs factor that stops a pair turning (convert_hf_to_gguf.py's value)
QWEN35_ARCHS = ("qwen35", "qwen35moe")  # llama.cpp's Qwen3.5 and Qwen3.5-MoE


# ---- refusals ----------------------------------------------------------------------------

def check_gemma4(config: TransformerConfig) -> None:
  """What llama.cpp's gemma4 would compute differently from this config, as one UserError."""
  if config.per_layer_input_dim and config.per_layer_vocab != config.vocab_size:
    raise UserError(f"llama.cpp's gemma4 reads the per-layer input table with vocab_size="
                    f"{config.vocab_size} rows; per_layer_input_vocab_size="
                    f"{config.per_layer_input_vocab_size} cannot be stored (export it with "
                    f"--format hf)")
  local = config.local_layers()
  if not any(local):
    raise UserError("llama.cpp's gemma4 needs at least one sliding layer (its cache is split "
                    "into sliding and full layers); this model has none (sliding_window="
                    f"{config.sliding_window}): export it with --format hf")
  first_shared = config.num_layers - config.num_kv_shared_layers
  for i in range(first_shared, config.num_layers):
    theirs = first_shared - (2 if local[i] else 1)
    if config.kv_source_layer(i) != theirs:
      raise UserError(f"llama.cpp's gemma4 gives a sharing {'sliding' if local[i] else 'full'} "
                      f"layer the keys/values of layer {theirs} (the last unshared layer if "
                      f"full, the one before it if sliding) but layer {i} of this model reads "
                      f"layer {config.kv_source_layer(i)}'s (layer_types="
                      f"{['sliding' if x else 'full' for x in local]}, num_kv_shared_layers="
                      f"{config.num_kv_shared_layers}); export it with --format hf, or end the "
                      f"unshared layers with a sliding then a full layer")
  wider_rope = config.global_head_dim not in (0, config.head_dim)
  if config.rope_local_theta is None and (wider_rope or config.global_rope_fraction != 1.0):
    raise UserError(f"llama.cpp's gemma4 turns sliding layers with an ordinary RoPE over "
                    f"head_dim={config.head_dim}, but with rope_local_theta=None this model's "
                    f"turn with the full layers' (global_head_dim={config.global_head_dim}, "
                    f"global_rope_fraction={config.global_rope_fraction}); set rope_local_theta")


def check_qwen35(config: TransformerConfig) -> None:
  """What llama.cpp's qwen35 would compute differently from this config, as one UserError."""
  if config.num_linear_layers and config.linear_key_head_dim != config.linear_value_head_dim:
    raise UserError(f"llama.cpp's qwen35 keeps one state size for Gated DeltaNet keys and "
                    f"values; linear_key_head_dim={config.linear_key_head_dim} != "
                    f"linear_value_head_dim={config.linear_value_head_dim} cannot be stored "
                    f"(export it with --format hf)")
  if config.rotary_dim % 2:
    raise UserError(f"llama.cpp's qwen35 turns pairs of features; partial_rotary_factor="
                    f"{config.partial_rotary_factor} of head_dim={config.head_dim} turns an odd "
                    f"count ({config.rotary_dim})")


# ---- keys --------------------------------------------------------------------------------

def add_gemma4_hparams(writer, config: TransformerConfig) -> None:
  """The sliding layers' pattern, window, head width, RoPE dims and base; key/value sharing;
  the per-layer input width; the final soft-cap."""
  writer.add_sliding_window(int(config.sliding_window))
  writer.add_sliding_window_pattern(config.local_layers())
  writer.add_key_length_swa(config.head_dim)
  writer.add_value_length_swa(config.head_dim)
  writer.add_rope_dimension_count_swa(config.head_dim)
  local = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
  writer.add_rope_freq_base_swa(float(local))
  writer.add_shared_kv_layers(config.num_kv_shared_layers)
  writer.add_embedding_length_per_layer_input(config.per_layer_input_dim)
  if config.final_logit_softcap is not None:
    writer.add_final_logit_softcapping(float(config.final_logit_softcap))


def gemma4_rope_freqs(config: TransformerConfig) -> np.ndarray:
  """The full layers' RoPE factors: 1 for each pair that turns, STILL for the rest."""
  dim = config.global_head_dim or config.head_dim
  turning = int(config.global_rope_fraction * dim // 2)  # as layers._global_sin_cos counts them
  return np.asarray([1.0] * turning + [STILL] * (dim // 2 - turning), np.float32)


def mrope_sections(pairs: int) -> list[int]:
  """Interleaved M-RoPE sections (time, height, width, extra) for `pairs` turning pairs: pair
  i reads stream i % 3 while i < 3 x that stream's section, else the extra stream, which text
  feeds position 0; Qwen3.5's own [11, 11, 10, 0] for 32 pairs."""
  time = -(-pairs // 3)
  height = -(-(pairs - time) // 2)
  return [time, height, pairs - time - height, 0]


def add_qwen35_hparams(writer, config: TransformerConfig) -> None:
  """The Gated DeltaNet sizes, which layers are linear, and the M-RoPE sections."""
  writer.add_ssm_conv_kernel(config.linear_conv_kernel)
  writer.add_ssm_state_size(config.linear_key_head_dim)
  writer.add_ssm_group_count(config.linear_num_key_heads)
  writer.add_ssm_time_step_rank(config.linear_num_value_heads)
  writer.add_ssm_inner_size(config.linear_num_value_heads * config.linear_value_head_dim)
  linear = [config.layer_is_linear(i) for i in range(config.num_layers)]
  writer.add_array(f"{writer.arch}.attention.recurrent_layers", linear)
  for interval in range(1, config.num_layers + 1):  # the older key, where a period says it
    if linear == [(i + 1) % interval != 0 for i in range(config.num_layers)]:
      writer.add_full_attention_interval(interval)
      break
  writer.add_rope_dimension_sections(mrope_sections(config.rotary_dim // 2))
  if config.shared_expert_mlp_dim:
    writer.add_expert_shared_feed_forward_length(config.shared_expert_mlp_dim)


# ---- tensors -----------------------------------------------------------------------------

def _tiled(x: np.ndarray, axis: int, config: TransformerConfig, width: int) -> np.ndarray:
  """x with its value-head axis (Hv blocks of `width`) in llama.cpp's tiled order."""
  Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
  shape = x.shape
  split = shape[:axis] + (Hk, Hv // Hk, width) + shape[axis + 1:]
  return np.swapaxes(x.reshape(split), axis, axis + 1).reshape(shape)


def qwen35_tensors(layer: int, rows: dict[str, np.ndarray], params: dict[str, np.ndarray],
                   config: TransformerConfig) -> list[tuple[tuple[str, ...], str, np.ndarray]]:
  """One layer's merged / reordered tensors: (the parameters each is made of, the pseudo
  parameter name gguf_layout names it by, the array as llama.cpp reads it). `rows`: each
  parameter as gguf_export lays matrices out ([out, in]); `params`: as stored. A shared
  expert's output gate [1, embed] is stored as the vector llama.cpp reads."""
  gate = f"layers/{layer}/mlp/shared_expert/output_gate"
  shared = [((gate,), gate, rows[gate].reshape(-1))] if gate in rows else []
  return _mixer_tensors(layer, rows, params, config) + shared


def _mixer_tensors(layer: int, rows: dict[str, np.ndarray], params: dict[str, np.ndarray],
                   config: TransformerConfig) -> list[tuple[tuple[str, ...], str, np.ndarray]]:
  p = f"layers/{layer}/attn/"
  if not config.layer_is_linear(layer):
    H, Dh = config.num_heads, config.head_dim
    q, gate = (rows[p + n].reshape(H, Dh, -1) for n in ("q", "out_gate"))
    merged = np.stack([q, gate], axis=1).reshape(2 * H * Dh, -1)
    return [((p + "q", p + "out_gate"), p + "q", merged)]
  dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
  heads = lambda x, axis, width=dv: _tiled(x, axis, config, width)
  qkv = np.concatenate([rows[p + "q"], rows[p + "k"], heads(rows[p + "v"], 0)], axis=0)
  conv = params[p + "conv"].T  # [channels, taps]
  split = 2 * config.linear_num_key_heads * dk
  conv = np.concatenate([conv[:split], heads(conv[split:], 0)], axis=0)
  return [((p + "q", p + "k", p + "v"), p + "qkv", qkv),
          ((p + "z",), p + "z", heads(rows[p + "z"], 0)),
          ((p + "b",), p + "b", heads(rows[p + "b"], 0, 1)),
          ((p + "a",), p + "a", heads(rows[p + "a"], 0, 1)),
          ((p + "conv",), p + "conv", conv),
          ((p + "dt_bias",), p + "dt_bias", heads(rows[p + "dt_bias"], 0, 1)),
          ((p + "A_log",), p + "A_log", heads(-np.exp(rows[p + "A_log"]), 0, 1)),
          ((p + "norm_scale",), p + "norm_scale", rows[p + "norm_scale"]),
          ((p + "o",), p + "o", heads(rows[p + "o"], 1))]


def gemma4_moe_tensors(layer: int, rows: dict[str, np.ndarray]
                       ) -> list[tuple[tuple[str, ...], str, np.ndarray]]:
  """A Gemma 4 MoE layer's experts' gate and up rows as one [expert, 2 x expert_ff, embed]."""
  p = f"layers/{layer}/mlp/"
  merged = np.concatenate([rows[p + "gate"], rows[p + "up"]], axis=1)
  return [((p + "gate", p + "up"), p + "gate_up", merged)]


def check_qwen35_blocks(config: TransformerConfig, types: dict[str, str]) -> None:
  """ssm_out's inputs are value heads, which llama.cpp reads tiled: unless each head fills whole
  blocks of 32 (or there is nothing to reorder), its q8_0 / q4_0 blocks would group other
  values than QAT rounded together (weights and activations alike), so they are refused."""
  if (config.linear_num_key_heads == config.linear_num_value_heads
      or config.linear_value_head_dim % 32 == 0):
    return
  for name, kind in types.items():
    parts = name.split("/")
    if kind in ("q8_0", "q4_0") and name.endswith("attn/o") and config.layer_is_linear(
        int(parts[1])):
      raise UserError(f"llama.cpp reads Gated DeltaNet value heads in another order, so {name} "
                      f"as {kind} would hold blocks of 32 that span other heads than QAT rounded "
                      f"together (linear_value_head_dim={config.linear_value_head_dim}); keep "
                      f"the linear layers' attn/o in full precision (a rule with weight_qtype "
                      f"None) or use a linear_value_head_dim that is a multiple of 32")
