"""Small building blocks of the decoder: RMSNorm, token embedding, gated MLP, RoPE.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (the vocabulary of
distillax.partitioning.rules.LOGICAL_AXES); the rules, not the model, decide where it lives.
Parameters are stored in `param_dtype` and cast to the compute `dtype` where they are used.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.models.config import TransformerConfig
from distillax.partitioning import constrain


def normal_param(rngs: nnx.Rngs, shape, stddev: float, dtype, logical_axes) -> nnx.Param:
  value = jax.random.normal(rngs.params(), shape, jnp.float32) * stddev
  return nnx.Param(value.astype(dtype), logical_axes=tuple(logical_axes))


class RMSNorm(nnx.Module):
  """Root-mean-square norm computed in float32; Gemma's form multiplies by (1 + scale).

  Normalises the last axis: the residual stream by default; `dim`/`logical_axes` name another
  feature axis (Qwen 3's q/k norms run over each head's ('head_dim',) features).
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs | None = None,
               dim: int | None = None, logical_axes: tuple[str, ...] = ("embed",)):
    del rngs  # deterministic init
    self.eps = config.norm_eps
    self.plus_one = config.norm_scale_plus_one
    init = jnp.zeros if self.plus_one else jnp.ones
    self.scale = nnx.Param(init((dim or config.embed_dim,), config.jnp_param_dtype),
                           logical_axes=tuple(logical_axes))

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    if self.plus_one:
      scale = 1.0 + scale
    return (x * scale).astype(x_BxLxD.dtype)


class Embedder(nnx.Module):
  """Token embedding table (vocab, embed); also the output projection when embeddings are tied."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    # With sqrt(D) scaling the looked-up rows end at unit RMS; otherwise GPT-style 0.02.
    stddev = config.embed_dim ** -0.5 if config.scale_embeddings else 0.02
    self.embedding = normal_param(rngs, (config.vocab_size, config.embed_dim), stddev,
                                  config.jnp_param_dtype, ("vocab", "embed"))
    self.scale = config.scale_embeddings
    self.dtype = config.jnp_dtype

  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    table_VxD = self.embedding[...].astype(self.dtype)
    x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0)
    if self.scale:
      # Gemma rounds the normaliser to the compute dtype before multiplying.
      x_BxLxD = x_BxLxD * jnp.asarray(math.sqrt(table_VxD.shape[-1]), self.dtype)
    return constrain(x_BxLxD, ("batch", "residual_length", "embed"))


class MLP(nnx.Module):
  """Gated feed-forward: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (tanh gelu)."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    D, F, pd = config.embed_dim, config.mlp_dim, config.jnp_param_dtype
    out_std = F ** -0.5 / math.sqrt(2 * config.num_layers)
    self.gate = normal_param(rngs, (D, F), D ** -0.5, pd, ("embed", "mlp"))
    self.up = normal_param(rngs, (D, F), D ** -0.5, pd, ("embed", "mlp"))
    self.down = normal_param(rngs, (F, D), out_std, pd, ("mlp", "embed"))
    self.activation = config.mlp_activation
    self.dtype = config.jnp_dtype

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    dt = self.dtype
    gate_BxLxF = jnp.einsum("BLD,DF->BLF", x_BxLxD, self.gate[...].astype(dt))
    up_BxLxF = jnp.einsum("BLD,DF->BLF", x_BxLxD, self.up[...].astype(dt))
    if self.activation == "swiglu":
      act_BxLxF = jax.nn.silu(gate_BxLxF)
    else:
      act_BxLxF = jax.nn.gelu(gate_BxLxF, approximate=True)
    h_BxLxF = constrain(act_BxLxF * up_BxLxF, ("batch", "length", "mlp"))
    out_BxLxD = jnp.einsum("BLF,FD->BLD", h_BxLxF, self.down[...].astype(dt))
    return constrain(out_BxLxD, ("batch", "residual_length", "embed"))


# ---- rotary position embedding -----------------------------------------------------------------

def rope_inverse_frequencies(config: TransformerConfig) -> jax.Array:
  """Per-pair inverse frequencies, with Llama 3.1's piecewise scaling when configured."""
  dim = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  factor = config.rope_scaling_factor
  if factor is None:
    return inv_freq
  low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
  old_len = config.rope_original_max_len
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
  scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(is_medium, smoothed, scaled)


def rope_sin_cos(positions_BxL: jax.Array, config: TransformerConfig):
  """(sin, cos) of shape (B, L, head_dim // 2) in float32."""
  angles = positions_BxL.astype(jnp.float32)[..., None] * rope_inverse_frequencies(config)
  return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x_BxLxHxK: jax.Array, sin_BxLxK2, cos_BxLxK2) -> jax.Array:
  """Rotates the two halves of each head (the 'rotate_half' layout of Llama/Gemma checkpoints)."""
  x = x_BxLxHxK.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  sin, cos = sin_BxLxK2[:, :, None, :], cos_BxLxK2[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxK.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  return x if cap is None else cap * jnp.tanh(x / cap)
