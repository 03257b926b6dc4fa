"""DeepSeek V3 (`DeepseekV3ForCausalLM`: DeepSeek-V3/R1/V3.1, Kimi K2, Moonlight) and GLM-4.5
(`Glm4MoeForCausalLM`), the families built on DeepSeek's mixture of experts, in Hugging Face
`config.json` <-> TransformerConfig, and which HF tensor each of their own parameters is.

Both: SwiGLU, the first `first_k_dense_replace` layers dense (width intermediate_size; model
moe_layers: the rest), each other layer n_routed_experts of width moe_intermediate_size picked by
DeepSeek's router (model.router='sigmoid': sigmoid scores, the e_score_correction_bias to choose
only, n_group / topk_group groups, norm_topk_prob, routed_scaling_factor) beside
n_shared_experts ungated shared experts (one MLP of n_shared_experts x moe_intermediate_size).
DeepSeek V3 attends with multi-head latent attention (models/attention/mla.py: q_lora_rank, or
none as V2-Lite and Moonlight-like checkpoints, kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim; rope_interleave) and YaRN with mscale / mscale_all_dim; GLM-4.5
with grouped-query attention, partial RoPE (half of each head), q/k/v biases (attention_bias)
and optional q/k norms (use_qk_norm). Multi-token-prediction layers a checkpoint carries
(num_nextn_predict_layers: layers past num_hidden_layers) are not part of the model:
checkpoint.py skips them with one line. What distillax does not read is refused in one line.
"""

from __future__ import annotations

from typing import Any, Mapping

from distillax.errors import UserError
from distillax.models.config import TransformerConfig

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
GLM4_MOE = "Glm4MoeForCausalLM"
FAMILIES = (DEEPSEEK_V3, GLM4_MOE)


def _int(hf: Mapping[str, Any], name: str, default: int = 0) -> int:
  value = hf.get(name)
  return default if value is None else int(value)


def sigmoid_moe_fields(hf: Mapping[str, Any], num_layers: int, where: str) -> dict[str, Any]:
  """The experts, router and dense lead layers of DeepSeek's MoE (none when every layer is
  dense: first_k_dense_replace >= num_hidden_layers)."""
  first_dense = _int(hf, "first_k_dense_replace")
  if first_dense >= num_layers:
    return {}
  width, shared = _int(hf, "moe_intermediate_size"), _int(hf, "n_shared_experts")
  if shared < 1:
    raise UserError(f"{where}: n_shared_experts={hf.get('n_shared_experts')!r}: distillax reads "
                    f"DeepSeek's MoE with its shared experts (n_shared_experts >= 1)")
  return dict(num_experts=_int(hf, "n_routed_experts"),
              num_experts_per_tok=_int(hf, "num_experts_per_tok"), moe_mlp_dim=width,
              router="sigmoid", router_score_bias=True, router_groups=_int(hf, "n_group", 1),
              router_groups_kept=_int(hf, "topk_group", 1),
              norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
              routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
              shared_expert_mlp_dim=shared * width, moe_layers=tuple(range(first_dense,
                                                                            num_layers)))


def deepseek_fields(hf: Mapping[str, Any], num_layers: int, where: str) -> dict[str, Any]:
  """DeepSeek V3: latent attention (queries straight or through q_lora_rank), its MoE."""
  nope, rope = _int(hf, "qk_nope_head_dim"), _int(hf, "qk_rope_head_dim")
  heads = _int(hf, "num_attention_heads")
  value = _int(hf, "v_head_dim") or nope + rope
  return dict(mlp_activation="swiglu", head_dim=nope + rope, num_kv_heads=heads,
              kv_lora_rank=_int(hf, "kv_lora_rank"), q_lora_rank=_int(hf, "q_lora_rank"),
              qk_rope_head_dim=rope, v_head_dim=0 if value == nope + rope else value,
              rope_interleaved=bool(hf.get("rope_interleave", True)),
              **sigmoid_moe_fields(hf, num_layers, where))


def glm4_moe_fields(hf: Mapping[str, Any], num_layers: int, where: str) -> dict[str, Any]:
  """GLM-4.5: grouped-query attention with partial RoPE (rope_parameters' partial_rotary_factor,
  0.5 by default), q/k/v biases, optional q/k norms; DeepSeek's MoE."""
  rope = dict(hf.get("rope_parameters") or {})
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
  return dict(mlp_activation="swiglu", qkv_bias=bool(hf.get("attention_bias", False)),
              qk_norm=bool(hf.get("use_qk_norm", False)), partial_rotary_factor=float(partial),
              **sigmoid_moe_fields(hf, num_layers, where))


def yarn_mscales(scaling: Mapping[str, Any], arch: str, where: str) -> dict[str, float]:
  """DeepSeek's YaRN magnitudes; refused in one line for the other families (transformers
  scales their attention otherwise)."""
  mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
  if not (mscale or all_dim):
    return {}
  if arch != DEEPSEEK_V3:
    raise UserError(f"{where}: yarn mscale={mscale}, mscale_all_dim={all_dim} is DeepSeek's "
                    f"form; distillax reads it for {DEEPSEEK_V3} only")
  return {"rope_yarn_mscale": float(mscale or 0.0), "rope_yarn_mscale_all_dim": float(all_dim
                                                                                       or 0.0)}


# ---- TransformerConfig -> config.json ------------------------------------------------------------

def _dense_lead(config: TransformerConfig) -> int | None:
  """How many first layers are dense when they are exactly the first ones (else None)."""
  dense = [i for i in range(config.num_layers) if not config.layer_is_moe(i)]
  return len(dense) if dense == list(range(len(dense))) else None


def family_architecture(config: TransformerConfig) -> str | None:
  """DeepSeek V3 (latent attention) or GLM-4.5 for a config with their fixed parts and nothing
  of the other families; None otherwise."""
  others = (config.mlp_activation != "swiglu" or config.norm_scale_plus_one
            or config.scale_embeddings or config.use_post_norms or config.attn_logit_softcap
            or config.final_logit_softcap or config.query_pre_attn_scalar
            or config.sliding_window or config.rope_free_layers or config.rope_local_theta
            or config.router_bias or config.expert_bias or config.moe_dense_mlp
            or config.moe_scale_inputs or config.shared_expert_gate or config.token_mixers
            or config.attn_output_gate or not config.pre_norms or config.qk_norm_across_heads
            or config.fused_qkv_gate_up or config.fused_qkvz_ba or config.qk_l2_norm
            or config.attention_chunk_size or config.attn_temperature_floor_scale
            or config.rope_scaling_factor is not None and config.rope_scaling_type != "yarn")
  moe = not config.num_experts or (
      config.router == "sigmoid" and config.router_score_bias and _dense_lead(config) is not None
      and config.shared_expert_mlp_dim and config.shared_expert_mlp_dim % config.expert_mlp_dim
      == 0)
  if others or not moe:
    return None
  if config.kv_lora_rank:
    return DEEPSEEK_V3
  mscale = config.rope_yarn_mscale or config.rope_yarn_mscale_all_dim or config.rope_interleaved
  return GLM4_MOE if config.num_experts and not mscale else None


def _moe_hf_fields(config: TransformerConfig) -> dict[str, Any]:
  if not config.num_experts:  # every layer dense; the expert fields unused
    return dict(first_k_dense_replace=config.num_layers, n_routed_experts=1,
                num_experts_per_tok=1, moe_intermediate_size=config.mlp_dim, n_shared_experts=1,
                n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)
  return dict(first_k_dense_replace=_dense_lead(config), n_routed_experts=config.num_experts,
              num_experts_per_tok=config.num_experts_per_tok,
              moe_intermediate_size=config.expert_mlp_dim,
              n_shared_experts=config.shared_expert_mlp_dim // config.expert_mlp_dim,
              n_group=config.router_groups, topk_group=config.router_groups_kept,
              routed_scaling_factor=config.routed_scaling_factor,
              norm_topk_prob=config.norm_topk_prob)


def family_hf_fields(config: TransformerConfig, arch: str, rope: dict[str, Any]
                     ) -> dict[str, Any]:
  """The config.json keys of DeepSeek V3 or GLM-4.5 beyond the shared ones (`rope`: the
  shared rope_parameters, to which GLM adds its partial_rotary_factor)."""
  fields = dict(hidden_act="silu", num_nextn_predict_layers=0, **_moe_hf_fields(config))
  if arch == GLM4_MOE:
    return dict(fields, attention_bias=config.qkv_bias, use_qk_norm=config.qk_norm,
                rope_parameters={**rope, "partial_rotary_factor": config.partial_rotary_factor})
  nope = config.head_dim - config.qk_rope_head_dim
  return dict(fields, q_lora_rank=config.q_lora_rank or None, kv_lora_rank=config.kv_lora_rank,
              qk_nope_head_dim=nope, qk_rope_head_dim=config.qk_rope_head_dim,
              v_head_dim=config.value_head_dim, rope_interleave=config.rope_interleaved,
              head_dim=config.qk_rope_head_dim, num_key_value_heads=config.num_heads)


# ---- which HF tensor each parameter is (names.py wraps the layouts) ------------------------------

# Block sub-path -> (name under model.layers.{i}., layout kind).
MLA_SOURCES = {
    ("attn", "q"): ("self_attn.q_proj.weight", "out_heads"),
    ("attn", "q_a"): ("self_attn.q_a_proj.weight", "T"),
    ("attn", "q_a_norm", "scale"): ("self_attn.q_a_layernorm.weight", "copy"),
    ("attn", "q_b"): ("self_attn.q_b_proj.weight", "out_heads"),
    ("attn", "kv_a"): ("self_attn.kv_a_proj_with_mqa.weight", "T"),
    ("attn", "kv_a_norm", "scale"): ("self_attn.kv_a_layernorm.weight", "copy"),
    ("attn", "kv_b"): ("self_attn.kv_b_proj.weight", "out_heads"),
    ("attn", "o"): ("self_attn.o_proj.weight", "in_heads"),
}
MOE_SOURCES = {  # the router's choice bias and the shared experts (plural in these families)
    ("mlp", "router_score_bias"): ("mlp.gate.e_score_correction_bias", "copy"),
    ("mlp", "shared_expert", "gate"): ("mlp.shared_experts.gate_proj.weight", "T"),
    ("mlp", "shared_expert", "up"): ("mlp.shared_experts.up_proj.weight", "T"),
    ("mlp", "shared_expert", "down"): ("mlp.shared_experts.down_proj.weight", "T"),
}


def mla_sources(config: TransformerConfig) -> dict[tuple[str, ...], tuple[str, str]]:
  """The latent attention's tensors: q_proj, or q_a_proj + its norm + q_b_proj."""
  drop = ({("attn", "q")} if config.q_lora_rank else
          {("attn", "q_a"), ("attn", "q_a_norm", "scale"), ("attn", "q_b")})
  return {k: v for k, v in MLA_SOURCES.items() if k not in drop}
