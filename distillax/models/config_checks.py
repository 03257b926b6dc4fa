"""What a `TransformerConfig` may hold: the choice lists of its string fields and the checks
`TransformerConfig.__post_init__` runs, kept apart so config.py stays the list of fields.

Nothing here imports config.py (it imports this): the checks read the config they are given.
The mixture-of-experts fields' checks are the MoE room's (moe/config_checks.py).
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp

from distillax.errors import ConfigError
from distillax.models.field_checks import check_choice, check_ints
from distillax.models.moe.config_checks import (  # noqa: F401 (re-exported)
    MOE_IMPLS, ROUTERS, check_moe)

MLP_ACTIVATIONS = ("swiglu", "geglu", "clamped_swiglu")
ROPE_SCALING_TYPES = ("llama3", "yarn", "linear", "longrope")
# Which RoPE a layer turns its queries and keys with (TransformerConfig.layer_ropes).
ROPE_GLOBAL, ROPE_LOCAL, ROPE_NONE = 0, 1, 2
REMAT_POLICIES = ("none", "full", "save_dots", "save_dots_no_batch", "save_attention",
                  "save_attention_qkv", "save_attention_mlp", "save_attention_up")
# models/attention/impl.py: auto picks a fused kernel where the platform has one, else blockwise.
ATTENTION_IMPLS = ("auto", "reference", "blockwise", "cudnn", "splash", "tokamax")
# A window no sequence reaches: the value a global-attention layer gets in the per-layer windows.
GLOBAL_WINDOW = 2**30
# Per-layer attention types, as Hugging Face's `layer_types` names them.
SLIDING, FULL = "sliding_attention", "full_attention"
LINEAR = "linear_attention"  # Qwen3.5's Gated DeltaNet layers, in HF's layer_types
# models/gated_deltanet.py: chunked for training, the token-by-token recurrence as reference.
LINEAR_ATTENTION_IMPLS = ("chunked", "recurrent")


def _check_splash_blocks(cfg) -> None:
  blocks = cfg.splash_blocks
  if isinstance(blocks, list):
    object.__setattr__(cfg, "splash_blocks", blocks := tuple(blocks))
  if not (isinstance(blocks, tuple) and len(blocks) == 3 and all(
      isinstance(b, int) and not isinstance(b, bool) and b > 0 and b % 128 == 0 for b in blocks)):
    raise ConfigError(f"model.splash_blocks={blocks!r} must be three multiples of 128 "
                      f"(block_q, block_kv, block_kv_compute), e.g. (512, 1024, 512)")
  if not isinstance(cfg.splash_fused_bwd, bool):
    raise ConfigError(f"model.splash_fused_bwd={cfg.splash_fused_bwd!r} must be True or False")


def check_config(cfg) -> None:
  """Raise one ConfigError line for the first field a user set wrong; normalise JSON lists
  to tuples (the dataclass is frozen, so through object.__setattr__)."""
  positive = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "mlp_dim", "max_seq_len")
  check_ints(cfg, positive, minimum=1)
  if cfg.num_heads % cfg.num_kv_heads:
    raise ConfigError(f"model.num_heads={cfg.num_heads} is not a multiple of model.num_kv_heads="
                      f"{cfg.num_kv_heads}; pick kv heads that divide the query heads")
  check_choice(cfg, "mlp_activation", MLP_ACTIVATIONS)
  check_choice(cfg, "remat", REMAT_POLICIES)
  check_choice(cfg, "attention_impl", ATTENTION_IMPLS)
  _check_splash_blocks(cfg)
  for name in ("qkv_bias", "qk_norm", "attn_out_bias", "attention_sinks", "router_bias",
               "expert_bias", "rope_yarn_truncate", "rope_interleaved"):
    if not isinstance(getattr(cfg, name), bool):
      raise ConfigError(f"model.{name}={getattr(cfg, name)!r} must be True or False")
  for name in ("param_dtype", "dtype"):
    value = getattr(cfg, name)
    try:
      dt = jnp.dtype(value)
    except TypeError:
      dt = None
    if not isinstance(value, str) or dt is None or not jnp.issubdtype(dt, jnp.floating):
      raise ConfigError(f"model.{name}={value!r} is not a floating dtype name; use e.g. "
                        f"'float32' or 'bfloat16'")
  if cfg.sliding_window is not None and cfg.sliding_window <= 0:
    raise ConfigError(f"model.sliding_window={cfg.sliding_window} must be positive or None")
  if cfg.sliding_window_pattern < 0:
    raise ConfigError(f"model.sliding_window_pattern={cfg.sliding_window_pattern} must be >= 0")
  _check_layer_types(cfg)
  _check_rope_free_layers(cfg)
  _check_token_mixers(cfg)
  check_moe(cfg)
  _check_gemma4(cfg)
  _check_olmo(cfg)
  _check_longrope(cfg)
  _check_llama4(cfg)
  _check_latent_attention(cfg)
  check_choice(cfg, "rope_scaling_type", ROPE_SCALING_TYPES)
  for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar",
               "rope_scaling_factor", "rope_attention_factor", "swiglu_limit",
               "rope_local_theta"):
    value = getattr(cfg, name)
    if value is not None and not value > 0:
      raise ConfigError(f"model.{name}={value!r} must be positive or None")

def _check_layer_types(cfg):
  if cfg.layer_types is None:
    return
  types = cfg.layer_types
  if isinstance(types, str) or not isinstance(types, Sequence):
    raise ConfigError(f"model.layer_types={types!r} must be a list of {SLIDING!r} / {FULL!r}, "
                      f"one per layer, or None")
  object.__setattr__(cfg, "layer_types", tuple(types))  # JSON gives a list
  if len(types) != cfg.num_layers or any(t not in (SLIDING, FULL) for t in types):
    raise ConfigError(f"model.layer_types={list(types)} must name {SLIDING!r} or {FULL!r} for "
                      f"each of the model.num_layers={cfg.num_layers} layers (or be None)")

def _check_rope_free_layers(cfg):
  layers = cfg.rope_free_layers
  if layers is None:
    return
  if (isinstance(layers, str) or not isinstance(layers, Sequence)
      or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < cfg.num_layers
             for i in layers)):
    raise ConfigError(f"model.rope_free_layers={layers!r} must list layer indices from 0 to "
                      f"{cfg.num_layers - 1} (model.num_layers={cfg.num_layers}), or be None")
  # One form per model: sorted, distinct, and None for no layer (JSON gives a list).
  object.__setattr__(cfg, "rope_free_layers", tuple(sorted(set(layers))) or None)

def _check_token_mixers(cfg):
  if cfg.token_mixers is not None:
    mixers = cfg.token_mixers
    if (isinstance(mixers, str) or not isinstance(mixers, Sequence) or len(mixers) !=
        cfg.num_layers or any(t not in (LINEAR, FULL) for t in mixers)):
      raise ConfigError(f"model.token_mixers={mixers!r} must name {LINEAR!r} or {FULL!r} for "
                        f"each of the model.num_layers={cfg.num_layers} layers (or be None)")
    object.__setattr__(cfg, "token_mixers", tuple(mixers))  # JSON gives a list
  check_ints(cfg, ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_conv_kernel", "linear_attention_chunk"),
                   minimum=1)
  if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
    raise ConfigError(f"model.linear_num_value_heads={cfg.linear_num_value_heads} is not a "
                      f"multiple of model.linear_num_key_heads={cfg.linear_num_key_heads}")
  check_choice(cfg, "linear_attention_impl", LINEAR_ATTENTION_IMPLS)
  rot = cfg.head_dim * cfg.partial_rotary_factor
  if not 0 < cfg.partial_rotary_factor <= 1 or rot != int(rot) or int(rot) % 2:
    raise ConfigError(f"model.partial_rotary_factor={cfg.partial_rotary_factor!r} must be in "
                      f"(0, 1] and turn an even number of the head_dim={cfg.head_dim} features")
  if not isinstance(cfg.attn_output_gate, bool):
    raise ConfigError(f"model.attn_output_gate={cfg.attn_output_gate!r} must be True or False")
  if cfg.num_linear_layers and cfg.scan_layers:
    raise ConfigError("model.scan_layers=True cannot stack the Gated DeltaNet and attention "
                      "layers of model.token_mixers (their weights differ); use "
                      "model.scan_layers=False")

def _check_olmo(cfg):
  for name in ("pre_norms", "qk_norm_across_heads", "use_post_norms"):
    if not isinstance(getattr(cfg, name), bool):
      raise ConfigError(f"model.{name}={getattr(cfg, name)!r} must be True or False")
  if not cfg.pre_norms and not cfg.use_post_norms:
    raise ConfigError("model.pre_norms=False leaves the blocks without a norm; set "
                      "model.use_post_norms=True (OLMo 2/3's post norms) or pre_norms=True")
  if cfg.qk_norm_across_heads and not cfg.qk_norm:
    raise ConfigError("model.qk_norm_across_heads=True says how the q/k norm runs, but "
                      "model.qk_norm=False; set qk_norm=True or qk_norm_across_heads=False")


def _check_longrope(cfg):
  """Phi's LongRoPE: one positive divisor per turning pair in each set, only with that type."""
  for name in ("fused_qkv_gate_up", "fused_qkvz_ba"):  # checkpoint layouts (Phi, Qwen3-Next)
    if not isinstance(getattr(cfg, name), bool):
      raise ConfigError(f"model.{name}={getattr(cfg, name)!r} must be True or False")
  longrope = cfg.rope_scaling_factor is not None and cfg.rope_scaling_type == "longrope"
  pairs = cfg.rotary_dim // 2
  for name in ("rope_short_factors", "rope_long_factors"):
    value = getattr(cfg, name)
    if value is None and not longrope:
      continue
    if not longrope:
      raise ConfigError(f"model.{name} is LongRoPE's; set model.rope_scaling_type='longrope' "
                        f"with a model.rope_scaling_factor, or {name}=None")
    if (isinstance(value, str) or not isinstance(value, Sequence) or len(value) != pairs
        or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0
               for x in value)):
      raise ConfigError(f"model.{name}={value!r} must list {pairs} positive divisors, one per "
                        f"pair RoPE turns (rotary_dim={cfg.rotary_dim})")
    object.__setattr__(cfg, name, tuple(float(x) for x in value))  # JSON gives a list


def _check_llama4(cfg):
  """Llama 4's chunked attention, q/k L2 norms and temperature tuning."""
  for name in ("attention_chunk_size", "attn_temperature_floor_scale"):
    value = getattr(cfg, name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
      raise ConfigError(f"model.{name}={value!r} must be a positive integer or None")
  if not isinstance(cfg.qk_l2_norm, bool):
    raise ConfigError(f"model.qk_l2_norm={cfg.qk_l2_norm!r} must be True or False")
  if not isinstance(cfg.attn_temperature_scale, (int, float)) or isinstance(
      cfg.attn_temperature_scale, bool):
    raise ConfigError(f"model.attn_temperature_scale={cfg.attn_temperature_scale!r} must be a "
                      f"number")
  if cfg.attention_chunk_size is not None and cfg.sliding_window is not None:
    raise ConfigError("model.attention_chunk_size and model.sliding_window both limit what a "
                      "layer attends; set one of them (Llama 4: attention_chunk_size)")
  if cfg.qk_l2_norm and cfg.qk_norm:
    raise ConfigError("model.qk_l2_norm=True (Llama 4's scale-free norm after RoPE) and "
                      "model.qk_norm=True (a learned norm before RoPE): set one of them")
  per_layer = (cfg.attention_chunk_size is not None or cfg.qk_l2_norm
               or cfg.attn_temperature_floor_scale is not None)
  if cfg.scan_layers and per_layer and cfg.rope_free_layers:
    raise ConfigError("model.scan_layers=True cannot stack Llama 4's layers (its RoPE-free "
                      "layers attend fully, unnormed, with temperature tuning, the others in "
                      "chunks); use model.scan_layers=False")


def _check_gemma4(cfg):
  check_ints(cfg, ("per_layer_input_dim", "per_layer_input_vocab_size",
                    "num_kv_shared_layers", "global_num_kv_heads"), minimum=0)
  if cfg.global_num_kv_heads and cfg.num_heads % cfg.global_num_kv_heads:
    raise ConfigError(f"model.num_heads={cfg.num_heads} is not a multiple of "
                      f"model.global_num_kv_heads={cfg.global_num_kv_heads}; pick kv heads that "
                      f"divide the query heads")
  if not isinstance(cfg.global_head_dim, int) or cfg.global_head_dim < 0:
    raise ConfigError(f"model.global_head_dim={cfg.global_head_dim!r} must be a non-negative "
                      f"integer (0 = head_dim)")
  frac = cfg.global_rope_fraction
  if not 0 < frac <= 1 or int(frac * cfg.layer_head_dim(cfg.num_layers - 1)) % 2:
    raise ConfigError(f"model.global_rope_fraction={frac!r} must be in (0, 1] and turn whole "
                      f"frequency pairs of the full layers' head_dim")
  for name in ("value_norm", "layer_scalar", "double_wide_shared_mlp", "attention_k_eq_v"):
    if not isinstance(getattr(cfg, name), bool):
      raise ConfigError(f"model.{name}={getattr(cfg, name)!r} must be True or False")
  shared = cfg.num_kv_shared_layers
  if shared and shared >= cfg.num_layers:
    raise ConfigError(f"model.num_kv_shared_layers={shared} must leave at least one of the "
                      f"model.num_layers={cfg.num_layers} layers computing keys/values")
  for i in range(cfg.num_layers - shared, cfg.num_layers):
    if cfg.kv_source_layer(i) is None:
      kind = SLIDING if cfg.layer_uses_sliding_window(i) else FULL
      raise ConfigError(f"model.num_kv_shared_layers={shared}: layer {i} ({kind}) has no "
                        f"earlier {kind} layer to share keys/values with; lower it")
  if cfg.num_linear_layers and shared:
    raise ConfigError("model.num_kv_shared_layers is for attention-only models; set it to 0 "
                      "with model.token_mixers")
  if cfg.scan_layers and (shared or cfg.per_layer_input_dim or cfg.attention_k_eq_v
                           or cfg.global_head_dim not in (0, cfg.head_dim)
                           or cfg.global_num_kv_heads not in (0, cfg.num_kv_heads)):
    raise ConfigError("model.scan_layers=True cannot stack Gemma 4's layers (per-layer inputs, "
                      "key/value sharing, keys as values or a wider global_head_dim / "
                      "global_num_kv_heads make them differ); use model.scan_layers=False")


# What multi-head latent attention replaces or has no place for: (field, its off value).
_NOT_WITH_MLA = (("sliding_window", None), ("qkv_bias", False), ("qk_norm", False),
                 ("attn_out_bias", False), ("attention_sinks", False),
                 ("attn_output_gate", False), ("token_mixers", None),
                 ("partial_rotary_factor", 1.0), ("num_kv_shared_layers", 0),
                 ("global_head_dim", 0), ("attention_k_eq_v", False), ("value_norm", False),
                 ("rope_free_layers", None), ("attention_chunk_size", None),
                 ("qk_l2_norm", False), ("attn_temperature_floor_scale", None),
                 ("fused_qkv_gate_up", False))


def _check_latent_attention(cfg):
  """DeepSeek's multi-head latent attention (kv_lora_rank > 0) and its YaRN magnitudes."""
  mla = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")
  check_ints(cfg, mla, minimum=0)
  for name in ("rope_yarn_mscale", "rope_yarn_mscale_all_dim"):
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
      raise ConfigError(f"model.{name}={value!r} must be a number >= 0 (0 = unset)")
    if value and (cfg.rope_scaling_type != "yarn" or cfg.rope_scaling_factor is None):
      raise ConfigError(f"model.{name}={value} is part of YaRN RoPE; set rope_scaling_type="
                        f"'yarn' with a rope_scaling_factor, or {name}=0")
  if not cfg.kv_lora_rank:
    used = [name for name in mla[1:] if getattr(cfg, name)]
    if used:
      raise ConfigError(f"model.{used[0]}={getattr(cfg, used[0])} is part of latent attention "
                        f"(DeepSeek's MLA), but model.kv_lora_rank=0; set kv_lora_rank or "
                        f"{used[0]}=0")
    return
  rope = cfg.qk_rope_head_dim
  if not rope or rope % 2 or rope >= cfg.head_dim:
    raise ConfigError(f"model.qk_rope_head_dim={rope} must be even, positive and below "
                      f"model.head_dim={cfg.head_dim} (the query/key head width: its no-RoPE "
                      f"features, then its RoPE ones)")
  for name, off in _NOT_WITH_MLA:
    if getattr(cfg, name) != off:
      raise ConfigError(f"model.{name}={getattr(cfg, name)!r} cannot be combined with "
                        f"model.kv_lora_rank={cfg.kv_lora_rank} (DeepSeek's latent attention); "
                        f"set {name}={off!r}")


def blocks_sharing_kv(cfg, layers: Sequence[int]) -> int:
  """How many of the teacher blocks `layers` (a student made of `cfg`'s blocks, in that order)
  attend with an earlier block's keys/values (Gemma 4's num_kv_shared_layers), once each still
  finds the block it shares with: they come last, and each one's source is the last block of
  its attention type before them, as the student's own config will derive it. Otherwise one
  ConfigError line naming why. A Gemma 4 student also ends with a full-attention block, as
  Gemma4ForCausalLM forces its last layer to be."""
  named = f"student.from_teacher.layers={tuple(layers)}"
  local = cfg.layer_uses_sliding_window
  if layers and (cfg.layer_scalar or cfg.per_layer_input_dim) and local(layers[-1]):
    raise ConfigError(f"{named} ends with teacher block {layers[-1]}, a {SLIDING} block; a "
                      f"Gemma 4 model's last layer attends fully (transformers forces it): end "
                      f"the list with a {FULL} block")
  first_shared = cfg.num_layers - cfg.num_kv_shared_layers
  sharing = [j for j, i in enumerate(layers) if i >= first_shared]
  owning = len(layers) - len(sharing)
  if sharing != list(range(owning, len(layers))):
    order = tuple(i for i in layers if i < first_shared) + tuple(layers[j] for j in sharing)
    raise ConfigError(f"{named}: teacher blocks {[layers[j] for j in sharing]} compute no "
                      f"keys/values of their own (model.num_kv_shared_layers="
                      f"{cfg.num_kv_shared_layers}), so they come after every block that "
                      f"does: list them last, e.g. {order}")
  for j in sharing:
    source = cfg.kv_source_layer(layers[j])
    same = [i for i in layers[:owning] if local(i) == local(layers[j])]
    if not same or same[-1] != source:
      kind = SLIDING if local(layers[j]) else FULL
      raise ConfigError(f"{named}: teacher block {layers[j]} attends with the keys/values of "
                        f"block {source}, so block {source} must be the last {kind} block "
                        f"before the sharing ones; add it there or leave block {layers[j]} out")
  return len(sharing)
