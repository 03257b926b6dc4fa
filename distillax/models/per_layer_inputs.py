"""Gemma 4's per-layer inputs: every layer gets a small extra input of its own, gated into the
residual stream after the MLP.

Why: a small model gets much of a large model's token knowledge from a cheap table lookup (the
second embedding table may even live off the accelerator) instead of from width. Each layer's
input is the mean (times sqrt(2)) of two parts: a row of a second token table
(per_layer_vocab x num_layers * P, scaled by sqrt(P)) and a projection of the scaled token
embeddings (times D**-0.5, RMS-normed over P). A block then adds
norm(project(gelu(gate(x)) * its_input)) to its residual (`PerLayerGate`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.models.config import TransformerConfig
from distillax.models.layers import RMSNorm, normal_param
from distillax.partitioning import constrain


class PerLayerInputs(nnx.Module):
  """(B, L, num_layers, P) per-layer inputs from the tokens and their scaled embeddings."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    D, N, P = config.embed_dim, config.num_layers, config.per_layer_input_dim
    pd = config.jnp_param_dtype
    self.embedding = normal_param(rngs, (config.per_layer_vocab, N * P), P ** -0.5, pd,
                                  ("vocab", None))
    self.projection = normal_param(rngs, (D, N * P), D ** -0.5, pd, ("embed", None))
    self.norm = RMSNorm(config, dim=P, logical_axes=(None,))
    self.config = config

  def __call__(self, tokens_BxL: jax.Array, embedded_BxLxD: jax.Array) -> jax.Array:
    cfg = self.config
    dt, N, P = cfg.jnp_dtype, cfg.num_layers, cfg.per_layer_input_dim
    B, L = tokens_BxL.shape
    table = self.embedding[...].astype(dt)
    # Like the main table, the sqrt(P) normaliser is rounded to the compute dtype first.
    own_BxLxNxP = (jnp.take(table, tokens_BxL, axis=0) * jnp.asarray(math.sqrt(P), dt)
                   ).reshape(B, L, N, P)
    proj = jnp.einsum("BLD,DX->BLX", embedded_BxLxD, self.projection[...].astype(dt))
    proj_BxLxNxP = self.norm((proj * jnp.asarray(cfg.embed_dim ** -0.5, dt)).reshape(B, L, N, P))
    return (proj_BxLxNxP + own_BxLxNxP) * jnp.asarray(2 ** -0.5, dt)


class PerLayerGate(nnx.Module):
  """One block's use of its input: x + norm(project(gelu_tanh(gate(x)) * input))."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    D, P, pd = config.embed_dim, config.per_layer_input_dim, config.jnp_param_dtype
    self.gate = normal_param(rngs, (D, P), D ** -0.5, pd, ("embed", None))
    self.projection = normal_param(rngs, (P, D), P ** -0.5 / math.sqrt(2 * config.num_layers),
                                   pd, (None, "embed"))
    self.norm = RMSNorm(config)
    self.dtype = config.jnp_dtype

  def __call__(self, x_BxLxD: jax.Array, input_BxLxP: jax.Array) -> jax.Array:
    dt = self.dtype
    h_BxLxP = jnp.einsum("BLD,DP->BLP", x_BxLxD, self.gate[...].astype(dt))
    h_BxLxP = jax.nn.gelu(h_BxLxP, approximate=True) * input_BxLxP.astype(dt)
    h_BxLxD = jnp.einsum("BLP,PD->BLD", h_BxLxP, self.projection[...].astype(dt))
    return constrain(x_BxLxD + self.norm(h_BxLxD), ("batch", "residual_length", "embed"))


def select_layer_columns(values: dict, layers, per_layer_dim: int) -> dict:
  """A PerLayerInputs' arrays (a pure dict) for a model made of blocks `layers` of this one,
  in that order: each block keeps its own P columns of the second table and of the projection
  (the shared norm over P stays), so a copied block gets the input it was trained with."""
  P = per_layer_dim
  columns = jnp.asarray([i * P + p for i in layers for p in range(P)], jnp.int32)
  return {**values, "embedding": jnp.take(values["embedding"], columns, axis=1),
          "projection": jnp.take(values["projection"], columns, axis=1)}
