"""OLMo 3 in Hugging Face `config.json` (Olmo3Config, model_type olmo3) <-> TransformerConfig.

OLMo 3 is OLMo 2's block: no norm before attention or the MLP, an RMSNorm after each
(model.pre_norms=False with use_post_norms), and q/k RMSNorms over the whole q and k
projections rather than per head (model.qk_norm_across_heads); SwiGLU, plain (w, not 1 + w)
norms, untied head by default. It adds sliding-window layers by `layer_types` (three sliding,
one full by default) and a RoPE per layer type: the full layers' (rope_theta with its scaling,
YaRN in the long-context checkpoints), the sliding layers' unscaled (model.rope_local_theta,
Gemma 3's field, set only when it differs from the full layers' RoPE).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from distillax.errors import UserError
from distillax.models.config import FULL, SLIDING, TransformerConfig, window_fields

OLMO3 = "Olmo3ForCausalLM"


def _ropes(hf: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """(the full layers' RoPE as a config dict `_rope` reads, the sliding layers' RoPE dict):
  transformers 5's rope_parameters keyed by layer type, or transformers 4's rope_theta +
  rope_scaling (which only the full layers apply)."""
  ropes = dict(hf.get("rope_parameters") or {})
  if FULL in ropes or SLIDING in ropes:
    full = dict(ropes.get(FULL) or {})
    local = dict(ropes.get(SLIDING) or {})
    theta = full.get("rope_theta", 500_000.0)
    return {"rope_parameters": {"rope_theta": theta, **full}}, {"rope_theta": theta, **local}
  theta = ropes.get("rope_theta", hf.get("rope_theta", 500_000.0))
  scaling = hf.get("rope_scaling") or (ropes if ropes.get("rope_type") not in (None, "default")
                                       else None)
  return {"rope_theta": theta, "rope_scaling": scaling}, {"rope_theta": theta}


def olmo3_fields(hf: Mapping[str, Any], num_layers: int, where: str,
                 read_rope: Callable[[Mapping[str, Any], str], dict]) -> dict[str, Any]:
  """The TransformerConfig switches of an OLMo 3 config.json; `read_rope` turns a config
  dict's RoPE keys into fields (hf/config.py's reader)."""
  act = hf.get("hidden_act") or "silu"
  if act != "silu":
    raise UserError(f"{where}: hidden_act={act!r} is not supported for {OLMO3} (only silu)")
  types = list(hf.get("layer_types") or [SLIDING if (i + 1) % 4 else FULL
                                         for i in range(num_layers)])
  if len(types) != num_layers or set(types) - {SLIDING, FULL}:
    raise UserError(f"{where}: layer_types={types} must name {SLIDING!r} or {FULL!r} for each of "
                    f"num_hidden_layers={num_layers} layers; fix the config.json")
  global_rope, local = _ropes(hf)
  if local.get("rope_type", "default") != "default":
    raise UserError(f"{where}: sliding_attention rope_type={local['rope_type']!r} is not "
                    f"supported; distillax turns OLMo 3's sliding layers with default RoPE")
  rope = read_rope(global_rope, where)
  window = window_fields(hf.get("sliding_window", 4096), [t == SLIDING for t in types])
  local_theta = float(local.get("rope_theta", rope["rope_theta"]))
  same = local_theta == rope["rope_theta"] and rope.get("rope_scaling_factor") is None
  return dict(mlp_activation="swiglu", pre_norms=False, use_post_norms=True, qk_norm=True,
              qk_norm_across_heads=True, **{"rope_scaling_factor": None, **rope},
              rope_local_theta=None if same or window["sliding_window"] is None else local_theta,
              **window)


def is_olmo3(config: TransformerConfig) -> bool:
  """Whether Olmo3ForCausalLM holds the config: OLMo's post-norm block and q/k norms over whole
  projections, SwiGLU, plain norms, nothing of the other families."""
  return (not config.pre_norms and config.use_post_norms and config.qk_norm_across_heads
          and config.mlp_activation == "swiglu" and not config.norm_scale_plus_one
          and not (config.scale_embeddings or config.qkv_bias or config.attn_out_bias
                   or config.attn_logit_softcap or config.final_logit_softcap
                   or config.query_pre_attn_scalar or config.num_experts
                   or config.rope_free_layers or config.token_mixers is not None
                   or config.attn_output_gate or config.partial_rotary_factor != 1.0
                   or config.attention_sinks or config.value_norm or config.layer_scalar
                   or config.per_layer_input_dim or config.num_kv_shared_layers
                   or config.attention_k_eq_v or config.global_head_dim
                   or config.global_num_kv_heads or config.global_rope_fraction != 1.0))


def olmo3_hf_fields(config: TransformerConfig,
                    rope_to_hf: Callable[[TransformerConfig], dict]) -> dict[str, Any]:
  """The config.json keys OLMo 3 adds to the shared ones: its layer types, the window and one
  RoPE per layer type (the sliding layers' unscaled)."""
  local = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
  return dict(hidden_act="silu", attention_bias=False,
              sliding_window=config.sliding_window or config.max_seq_len,
              layer_types=[SLIDING if x else FULL for x in config.local_layers()],
              rope_parameters={FULL: rope_to_hf(config),
                               SLIDING: {"rope_type": "default", "rope_theta": local}})
