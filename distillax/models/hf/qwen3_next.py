"""Qwen3-Next in Hugging Face `config.json` (Qwen3NextConfig, model_type qwen3_next) <->
TransformerConfig.

Qwen3-Next is the hybrid Qwen3.5 grew from, computing the same function: Gated DeltaNet layers
(models/gated_deltanet.py) and gated full-attention layers by `layer_types`, partial RoPE, q/k
norms and (1 + w) norms, with experts beside a sigmoid-gated shared expert (models/moe/shared.py:
softmax then top-k, renormalised by `norm_topk_prob`) in every `decoder_sparse_step`-th layer not
in `mlp_only_layers` (model.moe_layers; the others run a dense SwiGLU of intermediate_size).
What differs is the checkpoint: a linear layer stores q, k, v and z as one `in_proj_qkvz` and b,
a as one `in_proj_ba`, both grouped by key head (each key head's q, k, then its value heads' v
and z rows; its value heads' b then a rows): model.fused_qkvz_ba, read and written by names.py.
Its multi-token-prediction weights (`mtp.*`) are left out, as transformers leaves them.
"""

from __future__ import annotations

from typing import Any, Mapping

from distillax.models.config import TransformerConfig

QWEN3_NEXT = "Qwen3NextForCausalLM"


def qwen3_next_moe_fields(hf: Mapping[str, Any], moe_layers: tuple[int, ...]) -> dict[str, Any]:
  """The mixture-of-experts fields (transformers' defaults: 10 of 512 experts of width 512
  beside a shared one of 512, renormalised); `moe_layers` as Qwen3-MoE's code picks them."""
  experts = int(hf.get("num_experts", 512))
  if not experts:  # no experts: a dense MLP in every layer
    return dict(fused_qkvz_ba=True, num_experts=0)
  return dict(fused_qkvz_ba=True, num_experts=experts,
              num_experts_per_tok=int(hf.get("num_experts_per_tok", 10)),
              moe_mlp_dim=int(hf.get("moe_intermediate_size", 512)), router="softmax_topk",
              norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
              shared_expert_mlp_dim=int(hf.get("shared_expert_intermediate_size", 512)),
              shared_expert_gate=True, moe_layers=moe_layers)


def holds_qwen3_next_experts(config: TransformerConfig) -> bool:
  """Whether Qwen3NextForCausalLM holds the config's MLPs: none routed, or softmax top-k
  experts beside a sigmoid-gated shared expert."""
  if not config.num_experts:
    return not config.shared_expert_mlp_dim
  return bool(config.router == "softmax_topk" and config.shared_expert_mlp_dim
              and config.shared_expert_gate and config.routed_scaling_factor == 1.0
              and not (config.router_score_bias or config.moe_scale_inputs
                       or config.router_groups != 1))


def qwen3_next_hf_fields(config: TransformerConfig) -> dict[str, Any]:
  """The config.json keys of Qwen3-Next's MLPs (its attention and DeltaNet keys are Qwen3.5's)."""
  if not config.num_experts:
    return dict(num_experts=0, decoder_sparse_step=1, mlp_only_layers=[])
  dense = [i for i in range(config.num_layers) if not config.layer_is_moe(i)]
  return dict(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
              moe_intermediate_size=config.expert_mlp_dim, norm_topk_prob=config.norm_topk_prob,
              shared_expert_intermediate_size=config.shared_expert_mlp_dim,
              decoder_sparse_step=1, mlp_only_layers=dense, router_aux_loss_coef=0.0)
