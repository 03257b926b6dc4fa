"""Llama 4's text decoder in Hugging Face `config.json` (Llama4TextConfig, model_type llama4_text;
the text_config of a Llama4ForConditionalGeneration checkpoint) <-> TransformerConfig, and the
names of its tensors.

Llama 4 is Llama's block with: RoPE-free layers (`no_rope_layers` 0: every 4th by default;
model.rope_free_layers) that attend fully and scale their queries by position (temperature
tuning: floor_scale, attn_scale; model.attn_temperature_*), the other layers attending within
chunks of `attention_chunk_size` positions (model.attention_chunk_size) with scale-free q/k norms
after RoPE (`use_qk_norm`; model.qk_l2_norm); and a mixture of experts in every
`interleave_moe_layer_step`-th layer (`moe_layers`), the others a dense SwiGLU of
`intermediate_size_mlp`: the top-1 expert by router logit runs on the input times
sigmoid(logit) (router 'sigmoid' with model.moe_scale_inputs) beside a shared expert, both of
width `intermediate_size`. Its checkpoints hold each head's RoPE pairs side by side ((2i, 2i + 1):
Layout.pairs) and the experts stacked: gate and up as the column halves of
`experts.gate_up_proj` (expert, embed, 2 x width), down as `experts.down_proj`.
"""

from __future__ import annotations

from typing import Any, Mapping

from distillax.errors import UserError
from distillax.models.config import TransformerConfig
from distillax.models.hf.layout import COLUMNS, Layout

LLAMA4 = "Llama4ForCausalLM"
CHUNKED, FULL = "chunked_attention", "full_attention"


def llama4_fields(hf: Mapping[str, Any], num_layers: int, where: str) -> dict[str, Any]:
  """The TransformerConfig switches of a Llama 4 text config (transformers' defaults where a key
  is missing)."""
  act = hf.get("hidden_act") or "silu"
  if act != "silu":
    raise UserError(f"{where}: hidden_act={act!r} is not supported for {LLAMA4} (only silu)")
  interval = int(hf.get("no_rope_layer_interval", 4))
  flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
  chunk = hf.get("attention_chunk_size", 8192)
  types = [CHUNKED if flags[i] and chunk is not None else FULL for i in range(num_layers)]
  if len(flags) != num_layers or list(hf.get("layer_types") or types) != types:
    raise UserError(f"{where}: layer_types={hf.get('layer_types')}, no_rope_layers={flags}: "
                    f"distillax runs Llama 4 with chunked attention exactly in the layers with "
                    f"RoPE (as transformers' defaults derive them); fix the config.json")
  step = int(hf.get("interleave_moe_layer_step", 1))
  moe = hf.get("moe_layers")
  moe = list(range(step - 1, num_layers, step)) if moe is None else list(moe)
  if not moe:
    raise UserError(f"{where}: a Llama 4 without MoE layers (moe_layers=[]) is not supported; "
                    f"it is Llama's block: convert it as LlamaForCausalLM")
  tuning = bool(hf.get("attn_temperature_tuning", True))
  width = int(hf.get("intermediate_size", 8192))
  return dict(mlp_activation="swiglu",
              rope_free_layers=tuple(i for i in range(num_layers) if not flags[i]) or None,
              attention_chunk_size=None if chunk is None else int(chunk),
              qk_l2_norm=bool(hf.get("use_qk_norm", True)),
              attn_temperature_floor_scale=int(hf.get("floor_scale", 8192)) if tuning else None,
              attn_temperature_scale=float(hf.get("attn_scale", 0.1)),
              mlp_dim=int(hf.get("intermediate_size_mlp", 16384)),
              num_experts=int(hf.get("num_local_experts", 16)),
              num_experts_per_tok=int(hf.get("num_experts_per_tok", 1)), moe_mlp_dim=width,
              router="sigmoid", moe_scale_inputs=True, norm_topk_prob=False,
              shared_expert_mlp_dim=width, moe_layers=tuple(moe))


def is_llama4(config: TransformerConfig) -> bool:
  """Whether Llama4ForCausalLM holds the config: a Llama block with experts as Llama 4 routes
  them (top-1 by logit, input times the sigmoid score, beside an ungated shared expert of the
  experts' width), optionally chunked attention, q/k L2 norms and temperature tuning."""
  moe = (config.num_experts and config.router == "sigmoid" and config.moe_scale_inputs
         and config.shared_expert_mlp_dim == config.expert_mlp_dim
         and not config.shared_expert_gate and not config.norm_topk_prob
         and config.routed_scaling_factor == 1.0 and not config.router_score_bias
         and config.router_groups == 1)
  others = (config.norm_scale_plus_one or config.scale_embeddings or config.qkv_bias
            or config.qk_norm or config.attn_out_bias or config.attention_sinks
            or config.use_post_norms or config.attn_logit_softcap or config.final_logit_softcap
            or config.query_pre_attn_scalar or config.sliding_window is not None
            or config.token_mixers is not None or config.attn_output_gate
            or config.partial_rotary_factor != 1.0 or config.rope_local_theta is not None
            or config.fused_qkv_gate_up or config.router_bias or config.expert_bias
            or config.kv_lora_rank)
  rope = config.rope_scaling_factor is None or config.rope_scaling_type == "llama3"
  return bool(moe and rope and not others and config.mlp_activation == "swiglu"
              and config.pre_norms)


def llama4_hf_fields(config: TransformerConfig) -> dict[str, Any]:
  """The config.json keys Llama 4's text decoder adds to the shared ones."""
  n = config.num_layers
  moe = [i for i in range(n) if config.layer_is_moe(i)]
  step = moe[0] + 1  # interleave_moe_layer_step, where the pattern is one (moe_layers rules)
  floor = config.attn_temperature_floor_scale
  return dict(hidden_act="silu", intermediate_size=config.expert_mlp_dim,
              intermediate_size_mlp=config.mlp_dim, num_local_experts=config.num_experts,
              num_experts_per_tok=config.num_experts_per_tok, moe_layers=moe,
              interleave_moe_layer_step=step if moe == list(range(step - 1, n, step)) else 1,
              no_rope_layers=[int(config.layer_has_rope(i)) for i in range(n)],
              attention_chunk_size=config.attention_chunk_size,
              layer_types=[CHUNKED if config.layer_is_chunked(i) else FULL for i in range(n)],
              use_qk_norm=config.qk_l2_norm, attn_temperature_tuning=floor is not None,
              floor_scale=floor or 8192, attn_scale=config.attn_temperature_scale,
              router_aux_loss_coef=0.0)


def llama4_sources(config: TransformerConfig, moe: bool) -> dict[tuple[str, ...],
                                                                 tuple[str, Layout]]:
  """A Llama 4 layer's tensors where they differ from Llama's: q/k rows with side-by-side RoPE
  pairs, the MLP under `feed_forward`: a dense one, or the router, the stacked experts and the
  shared expert."""
  sources = {
      ("attn", "q"): ("self_attn.q_proj.weight", Layout("out_heads", pairs=True)),
      ("attn", "k"): ("self_attn.k_proj.weight", Layout("out_heads", pairs=True)),
  }
  mlp = {name: (f"feed_forward.{name}_proj.weight", Layout("T")) for name in ("gate", "up",
                                                                              "down")}
  if not moe:
    return {**sources, **{("mlp", k): v for k, v in mlp.items()}}
  return {**sources, **{("mlp", "shared_expert", k): (name.replace(
      "feed_forward.", "feed_forward.shared_expert."), layout) for k, (name, layout)
                        in mlp.items()},
          ("mlp", "router"): ("feed_forward.router.weight", Layout("T")),
          ("mlp", "gate"): ("feed_forward.experts.gate_up_proj", Layout(COLUMNS[0])),
          ("mlp", "up"): ("feed_forward.experts.gate_up_proj", Layout(COLUMNS[1])),
          ("mlp", "down"): ("feed_forward.experts.down_proj", Layout("copy"))}
