"""What a `TransformerConfig` may hold: the choice lists of its string fields and the checks
`TransformerConfig.__post_init__` runs, kept apart so config.py stays the list of fields.

Nothing here imports config.py (it imports this): the checks read the config they are given.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp

from distillax.errors import ConfigError

MLP_ACTIVATIONS = ("swiglu", "geglu", "clamped_swiglu")
ROPE_SCALING_TYPES = ("llama3", "yarn", "linear")
# Which RoPE a layer turns its queries and keys with (TransformerConfig.layer_ropes).
ROPE_GLOBAL, ROPE_LOCAL, ROPE_NONE = 0, 1, 2
# models/moe/layer.py: how a token's router logits pick and weight its experts, and how they run.
ROUTERS = ("softmax_topk", "topk_softmax", "gemma4", "sigmoid")
MOE_IMPLS = ("ragged", "dense", "tokamax")
REMAT_POLICIES = ("none", "full", "save_dots", "save_dots_no_batch")
# models/attention/impl.py: auto picks a fused kernel where the platform has one, else blockwise.
ATTENTION_IMPLS = ("auto", "reference", "blockwise", "cudnn", "splash", "tokamax")
# A window no sequence reaches: the value a global-attention layer gets in the per-layer windows.
GLOBAL_WINDOW = 2**30
# Per-layer attention types, as Hugging Face's `layer_types` names them.
SLIDING, FULL = "sliding_attention", "full_attention"
LINEAR = "linear_attention"  # Qwen3.5's Gated DeltaNet layers, in HF's layer_types
# models/gated_deltanet.py: chunked for training, the token-by-token recurrence as reference.
LINEAR_ATTENTION_IMPLS = ("chunked", "recurrent")


def check_config(cfg) -> None:
  """Raise one ConfigError line for the first field a user set wrong; normalise JSON lists
  to tuples (the dataclass is frozen, so through object.__setattr__)."""
  positive = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "mlp_dim", "max_seq_len")
  _check_ints(cfg, positive, minimum=1)
  if cfg.num_heads % cfg.num_kv_heads:
    raise ConfigError(f"model.num_heads={cfg.num_heads} is not a multiple of model.num_kv_heads="
                      f"{cfg.num_kv_heads}; pick kv heads that divide the query heads")
  _check_choice(cfg, "mlp_activation", MLP_ACTIVATIONS)
  _check_choice(cfg, "remat", REMAT_POLICIES)
  _check_choice(cfg, "attention_impl", ATTENTION_IMPLS)
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
  _check_moe(cfg)
  _check_gemma4(cfg)
  _check_latent_attention(cfg)
  _check_choice(cfg, "rope_scaling_type", ROPE_SCALING_TYPES)
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
  _check_ints(cfg, ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_conv_kernel", "linear_attention_chunk"),
                   minimum=1)
  if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
    raise ConfigError(f"model.linear_num_value_heads={cfg.linear_num_value_heads} is not a "
                      f"multiple of model.linear_num_key_heads={cfg.linear_num_key_heads}")
  _check_choice(cfg, "linear_attention_impl", LINEAR_ATTENTION_IMPLS)
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

def _check_ints(cfg, names, minimum: int):
  """Integer fields (not bools) of at least `minimum`: 1 for sizes, 0 where 0 means off."""
  what = "a positive integer" if minimum == 1 else "a non-negative integer (0 = off)"
  for name in names:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
      raise ConfigError(f"model.{name}={value!r} must be {what}")


def _check_choice(cfg, name: str, choices) -> None:
  value = getattr(cfg, name)
  if value not in choices:
    raise ConfigError(f"model.{name}={value!r}; choose one of {', '.join(choices)}")


def _check_moe(cfg):
  _check_ints(cfg, ("num_experts", "moe_mlp_dim"), minimum=0)
  k = cfg.num_experts_per_tok
  if cfg.num_experts and (not isinstance(k, int) or isinstance(k, bool)
                           or not 1 <= k <= cfg.num_experts):
    raise ConfigError(f"model.num_experts_per_tok={k!r} must be an integer from 1 to "
                      f"model.num_experts={cfg.num_experts}")
  _check_choice(cfg, "router", ROUTERS)
  _check_choice(cfg, "moe_impl", MOE_IMPLS)
  cf = cfg.moe_capacity_factor
  if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
    raise ConfigError(f"model.moe_capacity_factor={cf!r} must be a positive number (e.g. 1.25) "
                      f"or None (dropless)")
  if cfg.moe_dense_mlp not in (True, False) or (cfg.router == "gemma4") != (
      cfg.moe_dense_mlp is True) or cfg.moe_dense_mlp and not cfg.num_experts:
    raise ConfigError(f"model.moe_dense_mlp={cfg.moe_dense_mlp!r} with model.router="
                      f"{cfg.router!r}, model.num_experts={cfg.num_experts}: Gemma 4's MoE block "
                      f"is router='gemma4' with moe_dense_mlp=True and num_experts > 0; set all "
                      f"three or neither of the first two")
  for name in ("norm_topk_prob", "router_score_bias", "moe_scale_inputs"):
    if not isinstance(getattr(cfg, name), bool):
      raise ConfigError(f"model.{name}={getattr(cfg, name)!r} must be True or False")
  _check_moe_layers(cfg)
  _check_sigmoid_router(cfg)
  _check_shared_expert(cfg)


def _check_moe_layers(cfg):
  """moe_layers: layer indices, normalised to one form per model (sorted, distinct; None when
  every layer has experts), at least one of them, and no scan over layers that differ."""
  layers = cfg.moe_layers
  if layers is None:
    return
  if (isinstance(layers, str) or not isinstance(layers, Sequence)
      or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < cfg.num_layers
             for i in layers)):
    raise ConfigError(f"model.moe_layers={layers!r} must list layer indices from 0 to "
                      f"{cfg.num_layers - 1} (model.num_layers={cfg.num_layers}), or be None "
                      f"(experts in every layer)")
  layers = tuple(sorted(set(layers)))
  object.__setattr__(cfg, "moe_layers", None if len(layers) == cfg.num_layers else layers)
  if not cfg.num_experts:
    raise ConfigError(f"model.moe_layers={list(layers)} names layers with experts, but "
                      f"model.num_experts=0; set num_experts, or moe_layers=None")
  if not layers:
    raise ConfigError("model.moe_layers=() leaves no layer with experts; name at least one (a "
                      "student of teacher blocks: keep an MoE block), or set num_experts=0")
  if cfg.scan_layers and cfg.moe_layers is not None:
    raise ConfigError(f"model.scan_layers=True cannot stack dense and MoE layers (model."
                      f"moe_layers={list(layers)}: their weights differ); use "
                      f"model.scan_layers=False")


def _check_sigmoid_router(cfg):
  """The sigmoid router's parts (DeepSeek V3, GLM-4.5, Llama 4) are its own: a score bias and
  expert groups mean nothing to a softmax, and Llama 4's input scaling routes to one expert."""
  _check_ints(cfg, ("router_groups", "router_groups_kept"), minimum=1)
  factor = cfg.routed_scaling_factor
  if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
    raise ConfigError(f"model.routed_scaling_factor={factor!r} must be a positive number "
                      f"(1.0 = the routing weights as the router gives them)")
  sigmoid_only = [name for name, on in (("router_score_bias", cfg.router_score_bias),
                                        ("router_groups", cfg.router_groups != 1))
                  if on]
  if sigmoid_only and cfg.router != "sigmoid":
    raise ConfigError(f"model.{sigmoid_only[0]} is part of the sigmoid router (DeepSeek V3, "
                      f"GLM-4.5), but model.router={cfg.router!r}; set router='sigmoid' or "
                      f"leave it off")
  groups, kept = cfg.router_groups, cfg.router_groups_kept
  if groups > 1 and (cfg.num_experts % groups or cfg.num_experts // groups < 2
                     or not 1 <= kept <= groups):
    raise ConfigError(f"model.router_groups={groups}, router_groups_kept={kept}: the "
                      f"num_experts={cfg.num_experts} experts must split into groups of at least "
                      f"2 (each is scored by its best two), and 1 <= router_groups_kept <= "
                      f"router_groups")
  if cfg.num_experts and groups > 1 and cfg.num_experts_per_tok > kept * (
      cfg.num_experts // groups):
    raise ConfigError(f"model.num_experts_per_tok={cfg.num_experts_per_tok} is more than the "
                      f"{kept} kept groups of {cfg.num_experts // groups} experts hold; raise "
                      f"router_groups_kept")
  if cfg.moe_scale_inputs and cfg.num_experts_per_tok != 1:
    raise ConfigError(f"model.moe_scale_inputs=True (Llama 4) scales the one chosen expert's "
                      f"input by its weight, but model.num_experts_per_tok="
                      f"{cfg.num_experts_per_tok}; set it to 1 or moe_scale_inputs=False")


def _check_shared_expert(cfg):
  _check_ints(cfg, ("shared_expert_mlp_dim",), minimum=0)
  if cfg.shared_expert_mlp_dim and not cfg.num_experts:
    raise ConfigError(f"model.shared_expert_mlp_dim={cfg.shared_expert_mlp_dim} sits beside "
                      f"routed experts, but model.num_experts=0; set num_experts, or "
                      f"shared_expert_mlp_dim=0 (a dense model's MLP width is mlp_dim)")
  if not isinstance(cfg.shared_expert_gate, bool):
    raise ConfigError(f"model.shared_expert_gate={cfg.shared_expert_gate!r} must be True or "
                      f"False")
  if cfg.shared_expert_gate and not cfg.shared_expert_mlp_dim:
    raise ConfigError("model.shared_expert_gate=True gates a shared expert, but "
                      "model.shared_expert_mlp_dim=0; set its width or shared_expert_gate=False")


def _check_gemma4(cfg):
  _check_ints(cfg, ("per_layer_input_dim", "per_layer_input_vocab_size",
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
                 ("global_head_dim", 0), ("attention_k_eq_v", False), ("value_norm", False))


def _check_latent_attention(cfg):
  """DeepSeek's multi-head latent attention (kv_lora_rank > 0) and its YaRN magnitudes."""
  mla = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")
  _check_ints(cfg, mla, minimum=0)
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
