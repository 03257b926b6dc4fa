"""What a `TransformerConfig`'s mixture-of-experts fields may hold (`check_moe`, run by
models/config_checks.py): the router and its parts, which layers have experts, the shared
expert, the capacity. Reads the config it is given; never imports config.py.
"""

from __future__ import annotations

from typing import Sequence

from distillax.errors import ConfigError
from distillax.models.field_checks import check_choice, check_ints

# models/moe/layer.py: how a token's router logits pick and weight its experts, and how they run.
ROUTERS = ("softmax_topk", "topk_softmax", "gemma4", "sigmoid")
MOE_IMPLS = ("ragged", "dense", "tokamax")


def check_moe(cfg):
  """The mixture-of-experts fields (models/moe/layer.py and its routers)."""
  check_ints(cfg, ("num_experts", "moe_mlp_dim"), minimum=0)
  k = cfg.num_experts_per_tok
  if cfg.num_experts and (not isinstance(k, int) or isinstance(k, bool)
                           or not 1 <= k <= cfg.num_experts):
    raise ConfigError(f"model.num_experts_per_tok={k!r} must be an integer from 1 to "
                      f"model.num_experts={cfg.num_experts}")
  check_choice(cfg, "router", ROUTERS)
  check_choice(cfg, "moe_impl", MOE_IMPLS)
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
  check_ints(cfg, ("router_groups", "router_groups_kept"), minimum=1)
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
  check_ints(cfg, ("shared_expert_mlp_dim",), minimum=0)
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
