"""Gemma 4's text decoder in Hugging Face `config.json` (Gemma4TextConfig, model_type
gemma4_text) <-> TransformerConfig.

Gemma 4 is Gemma 2's block (post norms, GeGLU, sqrt(D) embeddings, final soft-cap) with plain
(w, not 1 + w) norms, q/k norms and scale-free value norms, attention scale 1, a learned scalar
per layer, per-layer inputs (models/per_layer_inputs.py), keys/values shared by the last
`num_kv_shared_layers` layers (twice as wide MLPs there with use_double_wide_mlp), a wider
head_dim on full layers (global_head_dim) and a RoPE per layer type: sliding layers' default
RoPE (model.rope_local_theta, Gemma 3's field), full layers' proportional RoPE (rope_theta,
global_rope_fraction). The 31B's full layers reuse their keys as values (attention_k_eq_v: no
v_proj; model.attention_k_eq_v) over fewer key/value heads (num_global_key_value_heads;
model.global_num_kv_heads). The 26B-A4B's MoE block (enable_moe_block: a dense MLP beside 128
routed experts, models/moe/gemma4.py) is model.router='gemma4' with model.moe_dense_mlp. What
distillax does not read yet is refused in one line, by name: bidirectional attention, scaled RoPE.
"""

from __future__ import annotations

from typing import Any, Mapping

from distillax.errors import UserError
from distillax.models.config import FULL, SLIDING, TransformerConfig, window_fields

GEMMA4 = "Gemma4ForCausalLM"
# transformers' default rope_parameters for a Gemma 4 config.json that names none.
_DEFAULT_ROPES = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                  FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                         "rope_theta": 1_000_000.0}}


def _rope(rope: Mapping[str, Any]) -> tuple[float, float] | None:
  """One layer type's (RoPE base, share of pairs turning) if distillax turns it as
  transformers does (None otherwise): the default RoPE, or 'proportional' unscaled."""
  kind = rope.get("rope_type", "default")
  if kind == "default" or (kind == "proportional" and rope.get("factor", 1.0) == 1.0):
    fraction = rope.get("partial_rotary_factor", 1.0) if kind == "proportional" else 1.0
    return float(rope.get("rope_theta", 10_000.0)), float(fraction)
  return None


def _refuse_unsupported(hf: Mapping[str, Any], ropes: Mapping[str, Any], where: str) -> None:
  local = _rope(ropes.get(SLIDING) or {})
  unsupported = {
      "use_bidirectional_attention": hf.get("use_bidirectional_attention") == "all",
      "rope_parameters": (None in {_rope(r) for r in ropes.values()}
                          or local is not None and local[1] != 1.0),
  }
  named = [k for k, bad in unsupported.items() if bad]
  if named:
    shown = ", ".join(f"{k}={hf.get(k, 'default')!r}" for k in named)
    raise UserError(f"{where}: Gemma 4 with {shown} is not supported yet; distillax reads Gemma "
                    f"4 decoders with dense MLPs, causal attention and unscaled RoPE (default on "
                    f"sliding layers, proportional on full ones)")


def _full_layer_shape(hf: Mapping[str, Any], types: list[str], kv_heads: int,
                      where: str) -> tuple[int, int]:
  """(head_dim, key/value heads) of the full layers as transformers 5.24 builds them: from
  per_layer_config when config.json has it (transformers writes it on save), else from
  global_head_dim (512 by default) and, only with attention_k_eq_v, num_global_key_value_heads
  (the released config.json files' keys)."""
  per_layer = hf.get("per_layer_config")
  if per_layer is None:
    heads = int(hf.get("num_global_key_value_heads") or kv_heads)
    return (int(hf.get("global_head_dim", 512)),
            heads if hf.get("attention_k_eq_v") else kv_heads)
  entries = [dict(per_layer.get(str(i)) or per_layer.get(i) or {}) for i in range(len(types))]
  full = {(int(e.get("head_dim", hf.get("head_dim", 256))),
           int(e.get("num_key_value_heads", kv_heads)))
          for e, kind in zip(entries, types) if kind == FULL}
  odd = [i for i, (e, kind) in enumerate(zip(entries, types))
         if (kind == SLIDING and e) or set(e) - {"head_dim", "num_key_value_heads"}]
  if len(full) != 1 or odd:
    raise UserError(f"{where}: per_layer_config={per_layer} gives layers of one type different "
                    f"shapes (or a sliding layer one of its own); distillax reads Gemma 4 with "
                    f"one head_dim and num_key_value_heads for all full_attention layers")
  return full.pop()


def gemma4_fields(hf: Mapping[str, Any], num_layers: int, where: str) -> dict[str, Any]:
  """The TransformerConfig switches of a Gemma4TextConfig dict; sliding layers 5:1 by default,
  the last layer full (transformers forces it)."""
  ropes = dict(hf.get("rope_parameters") or _DEFAULT_ROPES)
  _refuse_unsupported(hf, ropes, where)
  types = list(hf.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL
                                         for i in range(num_layers)])
  if len(types) != num_layers or set(types) - {SLIDING, FULL}:
    raise UserError(f"{where}: layer_types={types} must name {SLIDING!r} or {FULL!r} for each "
                    f"of num_hidden_layers={num_layers} layers; fix the config.json")
  types[-1] = FULL
  vocab = int(hf.get("vocab_size_per_layer_input", 262_144))
  (theta, fraction), (local, _) = _rope(ropes.get(FULL) or {}), _rope(ropes.get(SLIDING) or {})
  head_dim = int(hf.get("head_dim", 256))
  kv_heads = int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
  global_head_dim, global_kv_heads = _full_layer_shape(hf, types, kv_heads, where)
  shared = int(hf.get("num_kv_shared_layers", 0))
  keys_as_values = bool(hf.get("attention_k_eq_v"))
  moe = (dict(num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["top_k_experts"]),
             moe_mlp_dim=int(hf["moe_intermediate_size"]), router="gemma4", moe_dense_mlp=True)
         if hf.get("enable_moe_block") else {})
  return dict(mlp_activation="geglu", scale_embeddings=True, use_post_norms=True, qk_norm=True,
              value_norm=True, layer_scalar=True, query_pre_attn_scalar=1.0,
              final_logit_softcap=hf.get("final_logit_softcapping"),
              # Always set, even when the two bases are equal: the sliding layers turn a plain RoPE
              # over head_dim, never a slice of the full layers' proportional or wider one.
              rope_theta=theta, rope_local_theta=local,
              global_rope_fraction=fraction,
              global_head_dim=0 if global_head_dim == head_dim else global_head_dim,
              double_wide_shared_mlp=bool(hf.get("use_double_wide_mlp")) and shared > 0,
              per_layer_input_dim=int(hf.get("hidden_size_per_layer_input", 256) or 0),
              per_layer_input_vocab_size=0 if vocab == int(hf["vocab_size"]) else vocab,
              num_kv_shared_layers=shared, attention_k_eq_v=keys_as_values,
              global_num_kv_heads=0 if global_kv_heads == kv_heads else global_kv_heads,
              **moe, **window_fields(hf.get("sliding_window", 512), [t == SLIDING for t in types]))


def is_gemma4(config: TransformerConfig) -> bool:
  """Whether Gemma4ForCausalLM holds the config: its fixed parts (post norms, q/k and value
  norms, layer scalars, attention scale 1, plain norms, GeGLU, the last layer full) and
  nothing of the other families."""
  return (config.value_norm and config.layer_scalar and config.qk_norm and config.use_post_norms
          and config.scale_embeddings and config.mlp_activation == "geglu"
          and config.query_pre_attn_scalar == 1.0
          and config.moe_dense_mlp == bool(config.num_experts)  # its MoE block, or none
          and not config.local_layers()[-1]
          # transformers reads num_global_key_value_heads only with attention_k_eq_v
          and (config.attention_k_eq_v or not config.global_num_kv_heads)
          and not (config.norm_scale_plus_one or config.qkv_bias or config.attn_logit_softcap
                   or config.rope_scaling_factor or config.rope_free_layers
                   or config.attention_sinks or config.router_bias or config.expert_bias
                   or config.attn_out_bias or config.attn_output_gate
                   or config.token_mixers is not None or config.partial_rotary_factor != 1.0))


def gemma4_hf_fields(config: TransformerConfig) -> dict[str, Any]:
  """The config.json keys Gemma4TextConfig adds to the shared ones (token ids inside the
  vocabulary: transformers checks them)."""
  if config.rope_local_theta is None and (config.global_rope_fraction != 1.0
                                          or config.global_head_dim not in (0, config.head_dim)):
    raise UserError(f"Gemma4ForCausalLM turns sliding layers with an ordinary RoPE over "
                    f"head_dim={config.head_dim}, but with model.rope_local_theta=None this "
                    f"model's turn with the full layers' (global_head_dim="
                    f"{config.global_head_dim}, global_rope_fraction="
                    f"{config.global_rope_fraction}); set model.rope_local_theta")
  local = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
  full = {"rope_type": "default", "rope_theta": config.rope_theta}
  if config.global_rope_fraction != 1.0:
    full = {"rope_type": "proportional", "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.global_rope_fraction}
  return dict(hidden_activation="gelu_pytorch_tanh",
              global_head_dim=config.global_head_dim or config.head_dim,
              final_logit_softcapping=config.final_logit_softcap,
              sliding_window=config.sliding_window or config.max_seq_len,
              layer_types=[SLIDING if local else FULL for local in config.local_layers()],
              rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": local},
                               FULL: full},
              hidden_size_per_layer_input=config.per_layer_input_dim,
              vocab_size_per_layer_input=config.per_layer_vocab,
              num_kv_shared_layers=config.num_kv_shared_layers,
              attention_k_eq_v=config.attention_k_eq_v,
              **({"num_global_key_value_heads": config.global_num_kv_heads}
                 if config.global_num_kv_heads else {}),
              enable_moe_block=config.moe_dense_mlp,
              **(dict(num_experts=config.num_experts, top_k_experts=config.num_experts_per_tok,
                      moe_intermediate_size=config.expert_mlp_dim) if config.moe_dense_mlp else {}),
              use_double_wide_mlp=config.double_wide_shared_mlp,
              pad_token_id=0,
              bos_token_id=min(2, config.vocab_size - 1),
              eos_token_id=min(1, config.vocab_size - 1))
