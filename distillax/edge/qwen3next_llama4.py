"""What llama.cpp's qwen3next (Qwen3-Next) and llama4 (Llama 4's text decoder) architectures
read beyond one GGUF tensor per parameter: their refusals, keys and the tensors they store
differently from distillax. qwen3next's keys are qwen35's (gemma4_qwen35.add_qwen35_hparams: the
Gated DeltaNet sizes, which layers are linear).

Qwen3-Next (qwen3next). A Gated DeltaNet layer's q, k, v and z are one `ssm_in` and its b, a one
`ssm_ba`, grouped by key head as Hugging Face stores them (in_proj_qkvz / in_proj_ba), the conv
as ssm_conv1d [channels, taps] over q, k, v, A = -exp(A_log) as ssm_a; value heads stay in
Hugging Face's order, value head h reading key head h // (Hv / Hk), as llama.cpp's qwen3next
repeats them. A full-attention layer's queries and output gate are one attn_q (per head [query
rows, gate rows]). Every layer is routed experts beside a sigmoid-gated shared expert: llama.cpp
creates both in each layer, with a softmax router renormalised over the top k.

Llama 4 (llama4). Llama's tensors and interleaved RoPE (q/k rows permuted as for llama) with its
experts in every interleave_moe_layer_step-th layer (ffn_*_exps, the shared expert as ffn_*_shexp
of the experts' width) and dense ffn_* of feed_forward_length elsewhere. llama.cpp fixes in code
what a config could say otherwise: every 4th layer RoPE-free with temperature tuning at floor
8192 and scale 0.1, the others in chunks of 8192 positions, q/k L2 norms unless the model has
128 experts (Maverick); a model that differs is refused.
"""

from __future__ import annotations

import numpy as np

from distillax.errors import UserError
from distillax.models.config import TransformerConfig


# ---- qwen3next -----------------------------------------------------------------------------

# The pre-MLP norm is llama.cpp's post_attention_norm; the shared expert and its output gate.
_QWEN3NEXT_NAMES = {"mlp_norm/scale": "post_attention_norm.weight",
                    "mlp/shared_expert/gate": "ffn_gate_shexp.weight",
                    "mlp/shared_expert/up": "ffn_up_shexp.weight",
                    "mlp/shared_expert/down": "ffn_down_shexp.weight",
                    "mlp/shared_expert/output_gate": "ffn_gate_inp_shexp.weight"}
# A Gated DeltaNet layer's tensors (attn/qkvz, attn/ba: made by qwen3next_tensors).
_LINEAR_NAMES = {"attn/qkvz": "ssm_in.weight", "attn/ba": "ssm_ba.weight",
                 "attn/conv": "ssm_conv1d.weight", "attn/dt_bias": "ssm_dt.bias",
                 "attn/A_log": "ssm_a", "attn/norm_scale": "ssm_norm.weight",
                 "attn/o": "ssm_out.weight"}


def qwen3next_names(config: TransformerConfig, layer: int) -> dict[str, str]:
  """llama.cpp's names of layer `layer`'s parameters where they are not the shared layout's."""
  return {**_QWEN3NEXT_NAMES, **(_LINEAR_NAMES if config.layer_is_linear(layer) else {})}


def check_qwen3next(config: TransformerConfig) -> None:
  """What llama.cpp's qwen3next would compute differently from this config, as one UserError."""
  if not config.num_experts:  # (dense layers among MoE ones: arch_checks._check_experts refuses)
    raise UserError("llama.cpp's qwen3next runs routed experts in every layer; this model has "
                    "none (model.num_experts=0): export it with --format hf")
  if not config.shared_expert_mlp_dim or not config.norm_topk_prob:
    raise UserError(f"llama.cpp's qwen3next runs a shared expert beside renormalised top-k "
                    f"experts; shared_expert_mlp_dim={config.shared_expert_mlp_dim}, "
                    f"norm_topk_prob={config.norm_topk_prob} would run differently there")


def qwen3next_tensors(layer: int, rows: dict[str, np.ndarray],
                      params: dict[str, np.ndarray], config: TransformerConfig
                      ) -> list[tuple[tuple[str, ...], str, np.ndarray]]:
  """One layer's merged tensors: (the parameters each is made of, the pseudo parameter name
  gguf_layout names it by, the array as llama.cpp reads it). `rows`: each parameter as
  gguf_export lays matrices out ([out, in]); `params`: as stored."""
  p = f"layers/{layer}/attn/"
  gate = f"layers/{layer}/mlp/shared_expert/output_gate"
  out = [((gate,), gate, rows[gate].reshape(-1))] if gate in rows else []
  if not config.layer_is_linear(layer):
    H, Dh = config.num_heads, config.head_dim
    q, qgate = (rows[p + n].reshape(H, Dh, -1) for n in ("q", "out_gate"))
    return out + [((p + "q", p + "out_gate"), p + "q",
                   np.stack([q, qgate], axis=1).reshape(2 * H * Dh, -1))]
  Hk = config.linear_num_key_heads
  by_key_head = lambda *names: np.concatenate(
      [rows[p + n].reshape(Hk, -1, rows[p + n].shape[-1]) for n in names], axis=1
  ).reshape(-1, rows[p + names[0]].shape[-1])
  return out + [
      ((p + "q", p + "k", p + "v", p + "z"), p + "qkvz", by_key_head("q", "k", "v", "z")),
      ((p + "b", p + "a"), p + "ba", by_key_head("b", "a")),
      ((p + "conv",), p + "conv", params[p + "conv"].T),  # [channels, taps]
      ((p + "A_log",), p + "A_log", -np.exp(rows[p + "A_log"]))]


# ---- llama4 --------------------------------------------------------------------------------

_LLAMA4_NAMES = {"mlp/shared_expert/gate": "ffn_gate_shexp.weight",
                 "mlp/shared_expert/up": "ffn_up_shexp.weight",
                 "mlp/shared_expert/down": "ffn_down_shexp.weight"}


def llama4_names(config: TransformerConfig, layer: int) -> dict[str, str]:
  return _LLAMA4_NAMES


def _moe_step(config: TransformerConfig) -> int | None:
  """interleave_moe_layer_step when the MoE layers are every step-th (llama.cpp's rule)."""
  moe = [i for i in range(config.num_layers) if config.layer_is_moe(i)]
  step = moe[0] + 1 if moe else 0
  return step if step and moe == list(range(step - 1, config.num_layers, step)) else None


def check_llama4(config: TransformerConfig) -> None:
  """What llama.cpp's llama4 would compute differently from this config, as one UserError."""
  n = config.num_layers
  every_4th = tuple(i for i in range(n) if (i + 1) % 4 == 0) or None
  fixed = {"rope_free_layers": (config.rope_free_layers, every_4th),
           "attention_chunk_size": (config.attention_chunk_size, 8192),
           "qk_l2_norm": (config.qk_l2_norm, config.num_experts != 128)}
  if every_4th:
    fixed.update(attn_temperature_floor_scale=(config.attn_temperature_floor_scale, 8192),
                 attn_temperature_scale=(config.attn_temperature_scale, 0.1))
  named = [f"{k}={got!r} (llama.cpp: {want!r})" for k, (got, want) in fixed.items()
           if got != want]
  if _moe_step(config) is None:
    named.append(f"moe_layers={config.moe_layers} (llama.cpp: every k-th layer)")
  if config.shared_expert_mlp_dim != config.expert_mlp_dim:
    named.append(f"shared_expert_mlp_dim={config.shared_expert_mlp_dim} (llama.cpp: the "
                 f"experts' {config.expert_mlp_dim})")
  if named:
    raise UserError(f"llama.cpp's llama4 fixes in code what this model sets otherwise: "
                    f"{'; '.join(named)}; export it with --format hf")


def add_llama4_hparams(writer, config: TransformerConfig) -> None:
  """The MoE layers' step (llama.cpp's chunking, RoPE-free layers and temperature are its own)."""
  writer.add_interleave_moe_layer_step(_moe_step(config))
