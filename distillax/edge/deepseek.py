"""What llama.cpp's deepseek2 (DeepSeek V3, Kimi K2, Moonlight) and glm4moe (GLM-4.5) read
beyond one GGUF tensor per parameter: their refusals, their `{arch}.*` keys and the tensors they
store differently from distillax.

Both: the first leading_dense_block_count layers dense (ffn_gate/up/down of
feed_forward_length), the rest experts (ffn_*_exps of expert_feed_forward_length) routed by
sigmoid scores (expert_gating_func 2) whose choice adds exp_probs_b (the router's score bias),
within expert_group_used_count of expert_group_count groups (each scored by its two best, as
DeepSeek does), renormalised with expert_weights_norm and scaled by expert_weights_scale, beside
expert_shared_count shared experts (ffn_*_shexp). GLM-4.5's pre-MLP norm is llama.cpp's
post_attention_norm; its partial RoPE turns rope.dimension_count features (rotate-half).

DeepSeek's latent attention runs in llama.cpp as the absorbed form distillax's KV cache runs
(one shared key head of kv_lora_rank + qk_rope_head_dim features; key_length / value_length,
the expanded heads' in key_length_mla / value_length_mla): kv_b is stored split per head as
attn_k_b [head, kv_lora_rank, qk_nope] and attn_v_b [head, v_head_dim, kv_lora_rank], as
convert_hf_to_gguf.py splits kv_b_proj. llama.cpp turns adjacent feature pairs (DeepSeek's
rope_interleave): a model that turns rotate-half pairs has its RoPE rows reordered. YaRN: the
attention scale's m(mscale_all_dim) as rope.scaling.yarn_log_multiplier (0.1 x mscale_all_dim,
the converter's convention); the latent norms' epsilon is llama.cpp's layer epsilon.
"""

from __future__ import annotations

import numpy as np

from distillax.errors import UserError
from distillax.models.attention.mla import LATENT_NORM_EPS
from distillax.models.config import TransformerConfig

ARCHS = ("deepseek2", "glm4moe")

NAMES = {  # our block sub-path -> llama.cpp's name under blk.{i}.
    "attn/q_a": "attn_q_a.weight", "attn/q_a_norm/scale": "attn_q_a_norm.weight",
    "attn/q_b": "attn_q_b.weight", "attn/kv_a": "attn_kv_a_mqa.weight",
    "attn/kv_a_norm/scale": "attn_kv_a_norm.weight", "attn/k_b": "attn_k_b.weight",
    "attn/v_b": "attn_v_b.weight", "mlp/router_score_bias": "exp_probs_b.bias",
    "mlp/shared_expert/gate": "ffn_gate_shexp.weight",
    "mlp/shared_expert/up": "ffn_up_shexp.weight",
    "mlp/shared_expert/down": "ffn_down_shexp.weight",
}
GLM_NAMES = {"mlp_norm/scale": "post_attention_norm.weight"}


def check(config: TransformerConfig, arch: str) -> None:
  """What llama.cpp's deepseek2 / glm4moe would compute differently, as one UserError."""
  if arch == "deepseek2":
    if config.norm_eps != LATENT_NORM_EPS:
      raise UserError(f"llama.cpp's deepseek2 norms the latents with the layers' epsilon; "
                      f"norm_eps={config.norm_eps} differs from the latent norms' "
                      f"{LATENT_NORM_EPS} (DeepSeek's), so it would run differently there")
    if config.rope_yarn_mscale != config.rope_yarn_mscale_all_dim:
      raise UserError(f"llama.cpp's deepseek2 scales YaRN's cos/sin by 1; rope_yarn_mscale="
                      f"{config.rope_yarn_mscale} != rope_yarn_mscale_all_dim="
                      f"{config.rope_yarn_mscale_all_dim} would run differently there")
  if not config.num_experts and arch == "glm4moe":
    raise UserError("llama.cpp's glm4moe needs experts (n_expert > 0); this model is dense: "
                    "export it with --format hf")


def check_types(config: TransformerConfig, types: dict[str, str]) -> None:
  """deepseek2 stores kv_b split and transposed (k_b's blocks run along qk_nope, not the
  latent QAT blocked it along): a q8_0 / q4_0 kv_b would not be the numbers QAT trained."""
  for i in range(config.num_layers):
    kind = types.get(f"layers/{i}/attn/kv_b", "f32")
    if kind not in ("f32", "f16"):
      raise UserError(f"llama.cpp's deepseek2 stores attn/kv_b split into attn_k_b / attn_v_b, "
                      f"blocked along other axes than QAT's {kind} blocks (layer {i}); keep "
                      f"kv_b in full precision (a qat.rules entry with weight_qtype None for "
                      f"'.*attn/kv_b') or export with --quant f32 / f16")


def add_hparams(writer, config: TransformerConfig, arch: str) -> None:
  """The MoE keys of both (and deepseek2's latent-attention ones)."""
  dense = sum(not config.layer_is_moe(i) for i in range(config.num_layers))
  writer.add_leading_dense_block_count(dense)
  if config.num_experts:
    writer.add_expert_shared_count(config.shared_expert_mlp_dim // config.expert_mlp_dim)
    writer.add_expert_weights_scale(float(config.routed_scaling_factor))
    writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    import gguf  # the edge extra; write_gguf checked it is installed
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if config.router_groups > 1:
      writer.add_expert_group_count(config.router_groups)
      writer.add_expert_group_used_count(config.router_groups_kept)
  else:  # deepseek2 reads these for every model
    writer.add_expert_feed_forward_length(config.mlp_dim)
    writer.add_expert_shared_count(0)
  if arch == "deepseek2":
    writer.add_q_lora_rank(config.q_lora_rank)  # 0: queries projected directly (attn_q)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_key_length_mla(config.head_dim)
    writer.add_value_length_mla(config.value_head_dim)
    if config.rope_yarn_mscale_all_dim and config.rope_scaling_factor is not None:
      writer.add_rope_scaling_yarn_log_mul(0.1 * config.rope_yarn_mscale_all_dim)


def attention_lengths(config: TransformerConfig) -> tuple[int, int, int]:
  """(head_count_kv, key_length, value_length) of deepseek2's absorbed attention: one shared
  head of the latent and the RoPE key, values the latent."""
  R = config.kv_lora_rank
  return 1, R + config.qk_rope_head_dim, R


def _interleaved(rows: np.ndarray, rope: int) -> np.ndarray:
  """The last `rope` rows of every head's block (rows grouped per head) from rotate-half
  order (i, i + rope / 2) to adjacent pairs (2i, 2i + 1)."""
  order = np.stack([np.arange(rope // 2), np.arange(rope // 2) + rope // 2], 1).reshape(-1)
  out = rows.copy()
  out[..., -rope:, :] = rows[..., -rope:, :][..., order, :]
  return out


def deepseek_tensors(layer: int, rows: dict[str, np.ndarray], params: dict[str, np.ndarray],
                     config: TransformerConfig) -> list[tuple[tuple[str, ...], str, np.ndarray]]:
  """One layer's latent-attention tensors as llama.cpp reads them: (the parameters each is
  made of, the pseudo parameter name NAMES gives it, the array). kv_b split into k_b / v_b;
  RoPE rows in adjacent pairs when the model turns rotate-half pairs."""
  p = f"layers/{layer}/attn/"
  H, Dqk, Dr = config.num_heads, config.head_dim, config.qk_rope_head_dim
  kv_b = params[p + "kv_b"]  # (R, H, Dn + Dv)
  nope = Dqk - Dr
  out = [((p + "kv_b",), p + "k_b", np.ascontiguousarray(kv_b[:, :, :nope].transpose(1, 0, 2))),
         ((p + "kv_b",), p + "v_b", np.ascontiguousarray(kv_b[:, :, nope:].transpose(1, 2, 0)))]
  if not config.rope_interleaved:
    q = p + ("q_b" if config.q_lora_rank else "q")
    out.append(((q,), q, _interleaved(rows[q].reshape(H, Dqk, -1), Dr).reshape(H * Dqk, -1)))
    out.append(((p + "kv_a",), p + "kv_a", _interleaved(rows[p + "kv_a"], Dr)))
  return out
