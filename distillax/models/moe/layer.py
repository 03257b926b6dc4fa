"""Mixture-of-experts feed-forward: a router picks k of E gated MLPs per token.

The experts are three stacked weights, gate/up (expert, embed, mlp) and down (expert, mlp,
embed), so the rules place them like any parameter: expert parallelism is a rule for the
logical axis 'expert', never code here that reads the mesh.

Routing follows each family's own rule (softmax then top-k, top-k then softmax, or DeepSeek's
sigmoid scores with a choice bias and expert groups: models/moe/routing.py), because the numbers
must match its checkpoints. Which layers have experts is `moe_layers` (the others run the dense
`MLP`); a shared expert runs beside the routed ones where the family has one (moe/shared.py).

Dispatch is switched by `moe_impl`:
- 'ragged' (default, dropless): the T*k (token, expert) pairs are sorted by expert and each
  expert's contiguous group runs through one grouped matmul (`jax.lax.ragged_dot`), so the
  work is T*k rows whatever the routing and no token is ever dropped;
- 'dense': every expert runs on every token and the outputs are weighted by the (mostly zero)
  routing weights. E/k times the work; it is the reference the ragged path is tested against.
- 'tokamax': the ragged dispatch with tokamax's grouped matmul (models/moe/kernels.py).
When the rules split 'expert' over mesh axes (fsdp_ep, ep_tp), ragged and tokamax exchange the
tokens with the devices holding their experts (models/moe/parallel.py).

Optional capacity (`moe_capacity_factor`, routing.py): both dispatches drop the same
assignments (`keep_TxK`); the ragged one also skips their rows in the grouped matmul.
RouterStats counts the drops.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.models.config import TransformerConfig
from distillax.models.layers import activations, normal_param
from distillax.models.moe.kernels import tokamax_ragged_dot
from distillax.models.moe.parallel import routed_experts, run_experts
from distillax.models.moe.routing import (Routing, SigmoidGroups, expert_capacity,  # noqa: F401
                                          route, with_capacity)
from distillax.models.moe.shared import SharedExpert
from distillax.partitioning import constrain


# The ragged dispatch and tokamax's are one function (models/moe/parallel.py) over two grouped
# matmuls: a single place masks the rows a TPU leaves undefined.
ragged_experts = routed_experts


def dense_experts(x_TxD, routing: Routing, gate_ExDxF, up_ExDxF, down_ExFxD, act,
                  biases=None, up_act=None):
  """The reference: every expert on every token, weighted by a dense (T, E) routing matrix
  that is zero off the chosen experts."""
  E = gate_ExDxF.shape[0]
  one_hot_TxKxE = jax.nn.one_hot(routing.experts_TxK, E, dtype=routing.weights_TxK.dtype)
  combine_TxE = jnp.einsum("TK,TKE->TE", routing.weights_TxK, one_hot_TxKxE)
  gate_TxExF = jnp.einsum("TD,EDF->TEF", x_TxD, gate_ExDxF)
  up_TxExF = jnp.einsum("TD,EDF->TEF", x_TxD, up_ExDxF)
  if biases is not None:
    gate_TxExF, up_TxExF = gate_TxExF + biases[0], up_TxExF + biases[1]
  if up_act is not None:
    up_TxExF = up_act(up_TxExF)
  out_TxExD = jnp.einsum("TEF,EFD->TED", act(gate_TxExF) * up_TxExF, down_ExFxD)
  if biases is not None:
    out_TxExD = out_TxExD + biases[2]
  return jnp.einsum("TED,TE->TD", out_TxExD, combine_TxE.astype(out_TxExD.dtype))


_DISPATCH = {"ragged": routed_experts, "dense": dense_experts,
             "tokamax": functools.partial(routed_experts, ragged_dot=tokamax_ragged_dot)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
  """One layer's routing as sums over the real (non-padding) tokens, so micro-batches and
  data-parallel workers add up; a model's stats stack the layers on a leading axis."""

  load_E: jax.Array  # (token, expert) assignments per expert
  prob_E: jax.Array  # router softmax probability per expert, summed over tokens
  z: jax.Array  # squared logsumexp of the router logits, summed over tokens
  tokens: jax.Array  # real tokens
  dropped: jax.Array  # assignments dropped for capacity (0 when dropless)
  # Every token's float32 router logits, only when asked for (return_router_logits): not a sum.
  logits_BxLxE: jax.Array | None = None


def router_stats(routing: Routing, mask_T: jax.Array | None) -> RouterStats:
  """`load_E` counts the router's choices, dropped or not (the balance the aux loss sees)."""
  T, E = routing.logits_TxE.shape
  m_T = jnp.ones((T,), jnp.float32) if mask_T is None else mask_T.astype(jnp.float32)
  one_hot_TxKxE = jax.nn.one_hot(routing.experts_TxK, E, dtype=jnp.float32)
  load_E = jnp.einsum("TKE,T->E", one_hot_TxKxE, m_T)
  probs_TxE = (jax.nn.softmax(routing.logits_TxE, axis=-1) if routing.probs_TxE is None
               else routing.probs_TxE)
  prob_E = jnp.einsum("TE,T->E", probs_TxE, m_T)
  z = jnp.sum(jnp.square(jax.nn.logsumexp(routing.logits_TxE, axis=-1)) * m_T)
  dropped = (jnp.zeros(()) if routing.keep_TxK is None
             else jnp.sum(jnp.where(routing.keep_TxK, 0.0, m_T[:, None])))
  return RouterStats(load_E, prob_E, z, jnp.sum(m_T), dropped)


def router_losses(stats: RouterStats) -> dict[str, jax.Array]:
  """Per-layer means of layer-stacked stats (N, ...): the Switch load-balancing loss
  E * sum_e f_e P_e (f_e: share of the assignments to expert e, P_e: its mean router
  probability; 1 when perfectly balanced), the router z-loss mean(logsumexp(logits)^2), and
  each layer's max / mean load over its experts (1 = balanced, E / k = every token on the same
  k experts)."""
  tokens_N = jnp.maximum(stats.tokens, 1.0)
  E = stats.load_E.shape[-1]
  f_NxE = stats.load_E / jnp.maximum(jnp.sum(stats.load_E, axis=-1, keepdims=True), 1.0)
  p_NxE = stats.prob_E / tokens_N[:, None]
  mean_load_N = jnp.maximum(jnp.mean(stats.load_E, axis=-1), 1e-9)
  return {"aux_N": E * jnp.sum(f_NxE * p_NxE, axis=-1), "z_N": stats.z / tokens_N,
          "max_over_mean_load_N": jnp.max(stats.load_E, axis=-1) / mean_load_N}


def objective_terms(stats: RouterStats, tokens: jax.Array, aux_weight: float, z_weight: float):
  """What an objective adds for a mixture of experts: (loss sum, metric sums, per-layer ratios).
  The losses enter per token of the objective's loss (its sums are divided by the global token
  count, so they become per-token means) and are averaged over layers; each layer's max / mean
  tokens per expert and its share of (token, expert) assignments dropped for capacity
  (`expert_tokens_dropped_l{i}`, 0 when dropless) are ratios of sums."""
  terms = router_losses(stats)
  aux_sum = tokens * jnp.mean(terms["aux_N"])
  z_sum = tokens * jnp.mean(terms["z_N"])
  ratios = {f"expert_load_max_over_mean_l{i}": (jnp.max(stats.load_E[i]),
                                                 jnp.mean(stats.load_E[i]))
            for i in range(stats.load_E.shape[0])}
  ratios.update({f"expert_tokens_dropped_l{i}": (stats.dropped[i], jnp.sum(stats.load_E[i]))
                 for i in range(stats.load_E.shape[0])})
  return (aux_weight * aux_sum + z_weight * z_sum,
          {"moe_aux_loss": aux_sum, "router_z_loss": z_sum}, ratios)


class MoE(nnx.Module):
  """Router + E gated experts: the `MLP` of the layers with experts (`layer_is_moe`)."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    D, E, F = config.embed_dim, config.num_experts, config.expert_mlp_dim
    pd = config.jnp_param_dtype
    out_std = F ** -0.5 / math.sqrt(2 * config.num_layers)
    self.router = normal_param(rngs, (D, E), D ** -0.5, pd, ("embed", "expert"))
    self.gate = normal_param(rngs, (E, D, F), D ** -0.5, pd, ("expert", "embed", "mlp"))
    self.up = normal_param(rngs, (E, D, F), D ** -0.5, pd, ("expert", "embed", "mlp"))
    self.down = normal_param(rngs, (E, F, D), out_std, pd, ("expert", "mlp", "embed"))
    # gpt-oss: router and expert biases (zero at init).
    zeros = lambda shape, axes: nnx.Param(jnp.zeros(shape, pd), logical_axes=axes)
    self.router_bias = zeros((E,), ("expert",)) if config.router_bias else None
    # DeepSeek V3 / GLM-4.5: the bias added to the sigmoid scores to choose experts (routing.py).
    self.router_score_bias = zeros((E,), ("expert",)) if config.router_score_bias else None
    self.gate_bias, self.up_bias, self.down_bias = (
        (zeros((E, F), ("expert", "mlp")), zeros((E, F), ("expert", "mlp")),
         zeros((E, D), ("expert", "embed"))) if config.expert_bias else (None, None, None))
    # Qwen3.5-MoE, DeepSeek V3, GLM-4.5, Llama 4: a dense gated MLP beside the experts
    # (models/moe/shared.py).
    self.shared_expert = (SharedExpert(config, rngs=rngs) if config.shared_expert_mlp_dim
                          else None)
    self.act, self.up_act = activations(config)
    self.k = config.num_experts_per_tok
    self.router_kind = config.router
    self.norm_topk_prob = config.norm_topk_prob
    self.routed_scaling_factor = config.routed_scaling_factor
    self.groups = (config.router_groups, config.router_groups_kept)
    self.scale_inputs = config.moe_scale_inputs
    self.impl = config.moe_impl
    self.capacity_factor = config.moe_capacity_factor
    self.activation = config.mlp_activation
    self.dtype = config.jnp_dtype

  def routing(self, x_TxD: jax.Array) -> Routing:
    """Router logits in float32 (routing decisions must not flip with the compute dtype)."""
    logits_TxE = jnp.einsum("TD,DE->TE", x_TxD, self.router[...].astype(self.dtype),
                            preferred_element_type=jnp.float32)
    if self.router_bias is not None:
      logits_TxE = logits_TxE + self.router_bias[...].astype(jnp.float32)
    sigmoid = None
    if self.router_kind == "sigmoid":
      bias = None if self.router_score_bias is None else self.router_score_bias[...]
      sigmoid = SigmoidGroups(bias, *self.groups)
    return route(logits_TxE, self.k, self.router_kind, self.norm_topk_prob,
                 scale=self.routed_scaling_factor, sigmoid=sigmoid)

  def __call__(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None,
               return_router_logits: bool = False,
               router_x_BxLxD: jax.Array | None = None) -> tuple[jax.Array, RouterStats]:
    """The experts' output and this layer's RouterStats over the tokens whose segment id is
    not 0 (all tokens without segment ids); with `return_router_logits`, the stats also hold
    every token's router logits, computed from the router's input behind stop_gradient (a loss
    on them trains the router alone, not the layers below it). router_x_BxLxD: the router's
    input when it is not the experts' (Gemma 4 routes by the residual stream itself)."""
    dt = self.dtype
    B, L, D = x_BxLxD.shape
    x_TxD = x_BxLxD.astype(dt).reshape(B * L, D)
    router_x_TxD = x_TxD if router_x_BxLxD is None else router_x_BxLxD.astype(dt).reshape(-1, D)
    routing = self.routing(router_x_TxD)
    mask_T = None if segment_ids_BxL is None else (segment_ids_BxL > 0).reshape(B * L)
    capacity = expert_capacity(B * L, self.k, self.router.shape[-1], self.capacity_factor)
    if capacity is not None:
      routing = with_capacity(routing, capacity, mask_T)
    weights = [w[...].astype(dt) for w in (self.gate, self.up, self.down)]
    biases = (None if self.gate_bias is None
              else [b[...].astype(dt) for b in (self.gate_bias, self.up_bias, self.down_bias)])
    experts_in_TxD, dispatched = x_TxD, routing
    if self.scale_inputs:  # Llama 4: the one chosen expert runs on x times its weight
      experts_in_TxD = x_TxD * routing.weights_TxK.astype(dt)
      unit_TxK = (jnp.ones_like(routing.weights_TxK) if routing.keep_TxK is None
                  else routing.keep_TxK.astype(routing.weights_TxK.dtype))
      dispatched = dataclasses.replace(routing, weights_TxK=unit_TxK)
    # Experts the rules split (fsdp_ep, ep_tp) exchange tokens in a shard_map region.
    out_TxD = run_experts(self.impl, _DISPATCH[self.impl], experts_in_TxD, dispatched, weights,
                          self.act, biases, self.up_act)
    out_BxLxD = out_TxD.reshape(B, L, D)
    if self.shared_expert is not None:
      out_BxLxD = out_BxLxD + self.shared_expert(x_BxLxD.astype(dt))
    out_BxLxD = constrain(out_BxLxD, ("batch", "residual_length", "embed"))
    stats = router_stats(routing, mask_T)
    if return_router_logits:
      logits_TxE = self.routing(jax.lax.stop_gradient(router_x_TxD)).logits_TxE
      stats = dataclasses.replace(stats, logits_BxLxE=logits_TxE.reshape(B, L, -1))
    return out_BxLxD, stats
