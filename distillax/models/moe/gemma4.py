"""Gemma 4's MoE block (the 26B-A4B; HF enable_moe_block): a dense MLP and routed experts side
by side on the same residual stream, each with its own norms, their sum post-normed by the block.

  dense   = post_norm_1(MLP(pre_norm(x)))                 the block's mlp_norm is pre_norm
  experts = post_norm_2(MoE(pre_norm_2(x)))               routed by x itself, not a normed x
  out     = dense + experts                               then the block's post_mlp_norm

The router ('gemma4') projects rms(x) * router_scale * D^-0.5 (rms without a scale of its own)
to E logits, takes the softmax over all E, keeps the k largest, renormalises them to sum to 1
and multiplies each by its expert's learned scale. The experts are GeGLU like the dense MLP;
they run through moe.MoE, so every moe_impl (ragged, dense, tokamax) and expert parallelism
apply unchanged. The extra parameters are placed by the same logical axes ('embed', 'expert').
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.models.config import TransformerConfig
from distillax.models.layers import MLP, RMSNorm
from distillax.models.moe.layer import MoE, RouterStats, Routing, route


class Gemma4MoE(MoE):
  """Gemma 4's experts with their router scales, plus the dense branch and its norms."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, dense_dim: int):
    super().__init__(config, rngs=rngs)
    D, E, pd = config.embed_dim, config.num_experts, config.jnp_param_dtype
    self.router_scale = nnx.Param(jnp.ones((D,), pd), logical_axes=("embed",))
    self.expert_scale = nnx.Param(jnp.ones((E,), pd), logical_axes=("expert",))
    self.dense = MLP(config, rngs=rngs, dim=dense_dim)
    self.dense_post_norm = RMSNorm(config)
    self.experts_pre_norm = RMSNorm(config)
    self.experts_post_norm = RMSNorm(config)
    self.eps = config.norm_eps

  def routing(self, x_TxD: jax.Array) -> Routing:
    """Softmax-then-top-k over the scaled router input, renormalised, times the kept experts'
    scales (float32 logits, as every router here)."""
    D = x_TxD.shape[-1]
    x = x_TxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    x = x.astype(self.dtype) * (self.router_scale[...].astype(self.dtype)
                                * jnp.asarray(D ** -0.5, self.dtype))
    logits_TxE = jnp.einsum("TD,DE->TE", x, self.router[...].astype(self.dtype),
                            preferred_element_type=jnp.float32)
    routing = route(logits_TxE, self.k, "softmax_topk", norm_topk_prob=True)
    scale_TxK = jnp.take(self.expert_scale[...].astype(jnp.float32), routing.experts_TxK)
    return dataclasses.replace(routing, weights_TxK=routing.weights_TxK * scale_TxK)

  def __call__(self, normed_BxLxD: jax.Array, x_BxLxD: jax.Array,
               segment_ids_BxL: jax.Array | None = None,
               return_router_logits: bool = False) -> tuple[jax.Array, RouterStats]:
    """normed_BxLxD: the block's pre-MLP norm of x (the dense branch's input); x_BxLxD: the
    residual stream itself (the router's input, and the experts' through their own norm)."""
    dense_BxLxD = self.dense_post_norm(self.dense(normed_BxLxD))
    experts_BxLxD, stats = super().__call__(self.experts_pre_norm(x_BxLxD), segment_ids_BxL,
                                            return_router_logits, router_x_BxLxD=x_BxLxD)
    return dense_BxLxD + self.experts_post_norm(experts_BxLxD), stats
