"""How a mixture of experts' router logits pick each token's k experts and weigh them, and the
optional expert capacity that drops what an expert cannot take.

Each family's rule, because the numbers must match its checkpoints:
- 'softmax_topk' (Qwen3-MoE): softmax over all E logits, keep the k largest probabilities,
  renormalise them to sum to 1 only with `norm_topk_prob`;
- 'topk_softmax' (Mixtral, gpt-oss): keep the k largest logits, softmax over those k;
- 'sigmoid' (DeepSeek V3, GLM-4.5, Llama 4): each expert's own score sigmoid(logit). The experts
  are chosen by score plus a learned per-expert bias (`router_score_bias`, DeepSeek's
  e_score_correction_bias: auxiliary-loss-free balancing moves it between steps, it never
  weights an expert), first among the best `router_groups_kept` of `router_groups` groups of
  consecutive experts (each group scored by its two best), then the k best; their weights are
  the plain scores, renormalised with `norm_topk_prob`. Without bias and groups (Llama 4) the
  experts are chosen by logit, the same order as by score but free of sigmoid's saturation.
Every rule's weights are then multiplied by `routed_scaling_factor` (DeepSeek V3: 2.5).
Ties pick the lower expert index (`lax.top_k`), so every path routes alike.

Optional capacity (`moe_capacity_factor`; None = dropless): each expert takes at most
C = ceil(factor * T * k / E) of the (token, expert) assignments of a layer call's T tokens,
the first C in token order (flattened batch, row-major; padding tokens take no slot). An
assignment past that is dropped: it contributes 0 and the token keeps its other experts'
weighted output (no renormalisation).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from distillax.models.moe.dispatch_rows import group_sizes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
  """Which k experts each of T tokens goes to, with what weight, and the raw router logits
  (float32; the load-balancing and z losses read them)."""

  weights_TxK: jax.Array  # 0 where an assignment was dropped for capacity
  experts_TxK: jax.Array  # int32 expert indices, best first
  logits_TxE: jax.Array
  keep_TxK: jax.Array | None = None  # bool; None = dropless (every assignment kept)
  # Each token's router distribution over all E experts, for the load-balancing loss: the
  # softmax of the logits, or a sigmoid router's scores normalised to sum to 1 (DeepSeek V3's
  # balance loss reads those); None = the softmax.
  probs_TxE: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SigmoidGroups:
  """The sigmoid router's choice: the score bias (E,) or None, and the expert groups."""

  score_bias_E: jax.Array | None = None
  groups: int = 1
  groups_kept: int = 1


def route(logits_TxE: jax.Array, k: int, kind: str, norm_topk_prob: bool, *,
          scale: float = 1.0, sigmoid: SigmoidGroups | None = None) -> Routing:
  """The family's routing rule over float32 router logits (see the module docstring)."""
  logits_TxE = logits_TxE.astype(jnp.float32)
  probs_TxE = None
  if kind == "softmax_topk":
    weights_TxK, experts_TxK = jax.lax.top_k(jax.nn.softmax(logits_TxE, axis=-1), k)
    if norm_topk_prob:
      weights_TxK = weights_TxK / jnp.sum(weights_TxK, axis=-1, keepdims=True)
  elif kind == "topk_softmax":
    top_TxK, experts_TxK = jax.lax.top_k(logits_TxE, k)
    weights_TxK = jax.nn.softmax(top_TxK, axis=-1)
  elif kind == "sigmoid":
    weights_TxK, experts_TxK, probs_TxE = _sigmoid_route(logits_TxE, k, norm_topk_prob,
                                                         sigmoid or SigmoidGroups())
  else:
    raise ValueError(f"unknown router kind {kind!r}")
  if scale != 1.0:
    weights_TxK = weights_TxK * jnp.float32(scale)
  return Routing(weights_TxK, experts_TxK.astype(jnp.int32), logits_TxE, probs_TxE=probs_TxE)


def _sigmoid_route(logits_TxE, k: int, norm: bool, how: SigmoidGroups):
  """(weights, experts, normalised scores) of the sigmoid router."""
  scores_TxE = jax.nn.sigmoid(logits_TxE)
  if how.score_bias_E is None and how.groups == 1:
    choice_TxE = logits_TxE  # the order of the scores, without their saturation
  else:
    choice_TxE = scores_TxE
    if how.score_bias_E is not None:
      choice_TxE = choice_TxE + how.score_bias_E.astype(jnp.float32)
    if how.groups > 1:
      choice_TxE = _within_best_groups(choice_TxE, how.groups, how.groups_kept)
  _, experts_TxK = jax.lax.top_k(choice_TxE, k)
  weights_TxK = jnp.take_along_axis(scores_TxE, experts_TxK, axis=-1)
  if norm:  # DeepSeek's 1e-20 keeps an all-zero row finite
    weights_TxK = weights_TxK / (jnp.sum(weights_TxK, axis=-1, keepdims=True) + 1e-20)
  probs_TxE = scores_TxE / jnp.sum(scores_TxE, axis=-1, keepdims=True)
  return weights_TxK, experts_TxK, probs_TxE


def _within_best_groups(choice_TxE, groups: int, kept: int):
  """`choice_TxE` with every expert outside each token's `kept` best groups set to -inf; a
  group (consecutive experts) scores the sum of its two best choices."""
  T, E = choice_TxE.shape
  grouped_TxGxM = choice_TxE.reshape(T, groups, E // groups)
  group_score_TxG = jnp.sum(jax.lax.top_k(grouped_TxGxM, 2)[0], axis=-1)
  _, best_TxK = jax.lax.top_k(group_score_TxG, kept)
  open_TxG = jnp.any(best_TxK[:, :, None] == jnp.arange(groups)[None, None, :], axis=1)
  return jnp.where(jnp.repeat(open_TxG, E // groups, axis=1), choice_TxE, -jnp.inf)


def expert_capacity(tokens: int, k: int, num_experts: int, factor: float | None) -> int | None:
  """Assignments each expert takes per layer call: ceil(factor * T * k / E); None = dropless."""
  return None if factor is None else math.ceil(factor * tokens * k / num_experts)


def with_capacity(routing: Routing, capacity: int, mask_T: jax.Array | None) -> Routing:
  """`routing` with every expert's assignments past its first `capacity` (in token order, real
  tokens only) dropped: keep_TxK False and weight 0. Padding assignments are dropped too but
  take no slot (RouterStats counts only real tokens' drops)."""
  T, k = routing.experts_TxK.shape
  E = routing.logits_TxE.shape[-1]
  real_N = jnp.ones((T * k,), bool) if mask_T is None else jnp.repeat(mask_T.astype(bool), k)
  key_N = jnp.where(real_N, routing.experts_TxK.reshape(-1), E)  # padding sorts last
  order_N = jnp.argsort(key_N, stable=True)  # by expert, then token order
  counts = group_sizes(key_N, E + 1)
  starts = jnp.cumsum(counts) - counts
  rank_sorted_N = jnp.arange(T * k) - starts[key_N[order_N]]
  rank_N = jnp.zeros((T * k,), rank_sorted_N.dtype).at[order_N].set(rank_sorted_N)
  keep_TxK = (real_N & (rank_N < capacity)).reshape(T, k)
  weights_TxK = jnp.where(keep_TxK, routing.weights_TxK, 0.0)
  return dataclasses.replace(routing, weights_TxK=weights_TxK, keep_TxK=keep_TxK)
