"""Small building blocks of the decoder: RMSNorm, token embedding, gated MLP, RoPE.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (the vocabulary of
distillax.partitioning.rules.LOGICAL_AXES); the rules, not the model, decide where it lives.
Parameters are stored in `param_dtype` and cast to the compute `dtype` where they are used.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax.models import remat
from distillax.models.config import TransformerConfig
from distillax.models.counter_normal import counter_normal
from distillax.partitioning import constrain


def next_params_key(rngs: nnx.Rngs) -> jax.Array:
  """The next `params` key, its counter stepped eagerly where it is concrete (see
  concrete_rngs): a traced counter made every step read the whole trace so far (nnx asks the
  new count for its sharding, and a tracer's refusal names its origin), so an unrolled model's
  creation took time quadratic in its size: 22-39 s to trace Qwen3.5's, about 4 s now."""
  with jax.ensure_compile_time_eval():
    return rngs.params()


def concrete_rngs(seed) -> nnx.Rngs:
  """nnx.Rngs whose counters are concrete even inside a trace (a traced `seed`'s key stays
  traced): next_params_key then steps them without staging anything."""
  with jax.ensure_compile_time_eval():
    return nnx.Rngs(seed)


# One jitted function per shape: a model's creation (traced twice, by nnx.eval_shape and by the
# init jit) stages one call of it per parameter instead of counter_normal's ~40 primitives, and
# the traces of its few shapes are cached for every later model. The init program is the same
# (XLA inlines the call: the same values bit for bit, the same per-device iotas under a mesh);
# abstract_model of the demo's tiny teacher: 0.10 s -> 0.025 s.
_counter_normal = jax.jit(counter_normal, static_argnums=1)


def normal_param(rngs: nnx.Rngs, shape, stddev: float, dtype, logical_axes) -> nnx.Param:
  """N(0, stddev) values from the next `params` key (counter_normal.py: cheap to compile, the
  same bits on every backend), stored in `dtype`."""
  value = _counter_normal(next_params_key(rngs), tuple(int(d) for d in shape)) * stddev
  return nnx.Param(value.astype(dtype), logical_axes=tuple(logical_axes))


class RMSNorm(nnx.Module):
  """Root-mean-square norm computed in float32; Gemma's form multiplies by (1 + scale).

  Normalises the last axis: the residual stream by default; `dim`/`logical_axes` name another
  feature axis (Qwen 3's q/k norms run over each head's ('head_dim',) features), or several
  trailing axes at once (OLMo 2's q/k norms: dim (heads, head_dim) over a whole projection).
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs | None = None,
               dim: int | tuple[int, ...] | None = None,
               logical_axes: tuple[str, ...] = ("embed",), eps: float | None = None):
    """eps: this norm's, if not config.norm_eps (DeepSeek's latent norms: their class's 1e-6)."""
    del rngs  # deterministic init
    self.eps = config.norm_eps if eps is None else eps
    self.plus_one = config.norm_scale_plus_one
    init = jnp.zeros if self.plus_one else jnp.ones
    shape = dim if isinstance(dim, tuple) else (dim or config.embed_dim,)
    self.axes = tuple(range(-len(shape), 0))
    self.scale = nnx.Param(init(shape, config.jnp_param_dtype), logical_axes=tuple(logical_axes))

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=self.axes, keepdims=True) + self.eps)
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


def activations(config: TransformerConfig):
  """(act, up_act or None): the hidden of `config.mlp_activation` is act(gate) * up, or
  act(gate) * up_act(up). SwiGLU: silu; GeGLU: tanh gelu; gpt-oss's 'clamped_swiglu' clamps
  gate <= limit and |up| <= limit, then gate * sigmoid(alpha * gate) * (up + 1), as its
  checkpoints were trained."""
  if config.mlp_activation == "swiglu":
    return jax.nn.silu, None
  if config.mlp_activation == "geglu":
    return (lambda gate: jax.nn.gelu(gate, approximate=True)), None
  alpha, limit = config.swiglu_alpha, config.swiglu_limit

  def clamped_glu(gate):
    gate = jnp.minimum(gate, limit)
    return gate * jax.nn.sigmoid(gate * alpha)

  return clamped_glu, lambda up: jnp.clip(up, -limit, limit) + 1


class MLP(nnx.Module):
  """Gated feed-forward: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (tanh gelu)."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, dim: int | None = None):
    """dim: the hidden width, if not config.mlp_dim (Gemma 4's double-wide layers)."""
    D, F, pd = config.embed_dim, dim or config.mlp_dim, config.jnp_param_dtype
    out_std = F ** -0.5 / math.sqrt(2 * config.num_layers)
    self.gate = normal_param(rngs, (D, F), D ** -0.5, pd, ("embed", "mlp"))
    self.up = normal_param(rngs, (D, F), D ** -0.5, pd, ("embed", "mlp"))
    self.down = normal_param(rngs, (F, D), out_std, pd, ("mlp", "embed"))
    self.act, self.up_act = activations(config)
    self.dtype = config.jnp_dtype

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    dt = self.dtype
    gate_BxLxF = jnp.einsum("BLD,DF->BLF", x_BxLxD, self.gate[...].astype(dt))
    up_BxLxF = jnp.einsum("BLD,DF->BLF", x_BxLxD, self.up[...].astype(dt))
    gate_BxLxF, up_BxLxF = remat.name_mlp_gate_up(gate_BxLxF, up_BxLxF)
    if self.up_act is not None:
      up_BxLxF = self.up_act(up_BxLxF)
    h_BxLxF = constrain(self.act(gate_BxLxF) * up_BxLxF, ("batch", "length", "mlp"))
    out_BxLxD = jnp.einsum("BLF,FD->BLD", h_BxLxF, self.down[...].astype(dt))
    return constrain(out_BxLxD, ("batch", "residual_length", "embed"))


# ---- rotary position embedding -----------------------------------------------------------------

def rope_inverse_frequencies(config: TransformerConfig, long=False) -> jax.Array:
  """Per-pair inverse frequencies, with Llama 3.1's, YaRN's or LongRoPE's scaling when
  configured (LongRoPE: its long divisors where `long`, a bool that may be traced)."""
  dim = config.rotary_dim  # the head_dim features RoPE turns (Qwen3.5: a quarter)
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  factor = config.rope_scaling_factor
  if factor is None:
    return inv_freq
  if config.rope_scaling_type == "longrope":  # Phi-3/4: a divisor per pair
    short, longer = (jnp.asarray(f, jnp.float32) for f in (config.rope_short_factors,
                                                            config.rope_long_factors))
    return inv_freq / jnp.where(long, longer, short)
  if config.rope_scaling_type == "yarn":
    return _yarn_inverse_frequencies(config, inv_freq)
  if config.rope_scaling_type == "linear":  # Gemma 3's global layers: positions / factor
    return inv_freq / factor
  low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
  old_len = config.rope_original_max_len
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
  scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(is_medium, smoothed, scaled)


def _yarn_inverse_frequencies(config: TransformerConfig, inv_freq: jax.Array) -> jax.Array:
  """YaRN (gpt-oss): pairs turning more than beta_fast times over the original context keep
  their frequency, pairs turning fewer than beta_slow times are slowed by `factor`, with a
  linear ramp over the pair index between the two (its ends floored/ceiled with truncate)."""
  dim, theta, old_len = config.rotary_dim, config.rope_theta, config.rope_original_max_len
  pair_of = lambda turns: dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))
  low, high = pair_of(config.rope_yarn_beta_fast), pair_of(config.rope_yarn_beta_slow)
  if config.rope_yarn_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  high = high + 0.001 if low == high else high  # a one-point ramp would divide by zero
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
  return inv_freq / config.rope_scaling_factor * ramp + inv_freq * (1.0 - ramp)


def rope_attention_factor(config: TransformerConfig) -> float:
  """What YaRN and LongRoPE multiply cos and sin by (so the attention logits by its square):
  the configured factor, else DeepSeek's YaRN m(mscale) / m(mscale_all_dim) (both set), YaRN's
  0.1 ln(factor) + 1, LongRoPE's
  sqrt(1 + ln(factor) / ln(original context)); 1 for other RoPE."""
  factor = config.rope_scaling_factor
  if factor is None or config.rope_scaling_type not in ("yarn", "longrope"):
    return 1.0
  if config.rope_attention_factor is not None:
    return float(config.rope_attention_factor)
  if config.rope_yarn_mscale and config.rope_yarn_mscale_all_dim:  # DeepSeek's (1 when equal)
    return (config.yarn_mscale(config.rope_yarn_mscale)
            / config.yarn_mscale(config.rope_yarn_mscale_all_dim))
  if factor <= 1:
    return 1.0
  if config.rope_scaling_type == "longrope":
    return math.sqrt(1 + math.log(factor) / math.log(config.rope_original_max_len))
  return 0.1 * math.log(factor) + 1.0


def rope_sin_cos(positions_BxL: jax.Array, config: TransformerConfig):
  """(sin, cos) of shape (B, L, head_dim // 2) in float32 (YaRN, LongRoPE: times the attention
  factor). LongRoPE turns with its long divisors when any position of the call reaches
  rope_original_max_len, as transformers picks them per forward."""
  long = False
  if config.rope_scaling_factor is not None and config.rope_scaling_type == "longrope":
    long = jnp.max(positions_BxL) + 1 > config.rope_original_max_len
  inv_freq = rope_inverse_frequencies(config, long)
  angles = positions_BxL.astype(jnp.float32)[..., None] * inv_freq
  scale = rope_attention_factor(config)
  if scale == 1.0:
    return jnp.sin(angles), jnp.cos(angles)
  return jnp.sin(angles) * scale, jnp.cos(angles) * scale


def rope_tables(positions_BxL: jax.Array, config: TransformerConfig):
  """(sin_RxBxLxK2, cos_RxBxLxK2): the sin/cos of each RoPE a layer may turn with, indexed by
  config.layer_ropes(): the global one, the local one (Gemma 3's sliding layers: base
  rope_local_theta, unscaled) and none (sin 0, cos 1: the identity, SmolLM3's RoPE-free
  layers), so a scanned stack picks its layer's with an index. Gemma 4's global RoPE is wider
  (global_head_dim) and proportional; narrower tables are padded with the identity (sin 0,
  cos 1) and each layer takes the first head_dim // 2 pairs of its own."""
  sin, cos = _global_sin_cos(positions_BxL, config)
  local = (sin, cos)
  if config.rope_local_theta is not None:
    local = rope_sin_cos(positions_BxL, config.replace(
        rope_theta=config.rope_local_theta, rope_scaling_factor=None, rope_short_factors=None,
        rope_long_factors=None))
  width = max(sin.shape[-1], local[0].shape[-1])
  pad = lambda x, value: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])],
                                 constant_values=value)
  sins = [pad(sin, 0.0), pad(local[0], 0.0), jnp.zeros_like(pad(sin, 0.0))]
  coss = [pad(cos, 1.0), pad(local[1], 1.0), jnp.ones_like(pad(cos, 1.0))]
  return jnp.stack(sins), jnp.stack(coss)


def _global_sin_cos(positions_BxL: jax.Array, config: TransformerConfig):
  """The global RoPE's (sin, cos); Gemma 4's proportional form over global_head_dim: the first
  global_rope_fraction of the pairs turn at rope_theta^(-2i/global_head_dim), the rest not."""
  if not config.global_head_dim and config.global_rope_fraction == 1.0:
    return rope_sin_cos(positions_BxL, config)
  dim = config.global_head_dim or config.head_dim
  pairs = int(config.global_rope_fraction * dim // 2)
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, 2 * pairs, 2, dtype=jnp.float32) / dim))
  inv_freq = jnp.concatenate([inv_freq, jnp.zeros((dim // 2 - pairs,), jnp.float32)])
  angles = positions_BxL.astype(jnp.float32)[..., None] * inv_freq
  return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x_BxLxHxK: jax.Array, sin_BxLxK2, cos_BxLxK2, interleaved: bool = False,
               swap_on_mxu: bool = False) -> jax.Array:
  """Rotates the two halves of each head (the 'rotate_half' layout of Llama/Gemma checkpoints);
  `interleaved` (DeepSeek's rope_interleave): rotates adjacent pairs (2i, 2i+1) instead and
  returns the turned even features then the odd ones, as transformers does (queries and keys
  alike, so their products are unchanged). swap_on_mxu: the same rotation over whole heads
  (_rope_whole_heads), what the attention layer asks for on a TPU."""
  rotary = 2 * sin_BxLxK2.shape[-1]
  if rotary < x_BxLxHxK.shape[-1]:  # partial RoPE (Qwen3.5): the head's first features turn
    turned = apply_rope(x_BxLxHxK[..., :rotary], sin_BxLxK2, cos_BxLxK2, interleaved,
                        swap_on_mxu)
    return jnp.concatenate([turned, x_BxLxHxK[..., rotary:]], axis=-1)
  if swap_on_mxu and not interleaved:
    return _rope_whole_heads(x_BxLxHxK, sin_BxLxK2, cos_BxLxK2)
  x = x_BxLxHxK.astype(jnp.float32)
  x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else jnp.split(x, 2, axis=-1)
  sin, cos = sin_BxLxK2[:, :, None, :], cos_BxLxK2[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxK.dtype)


def _half_swap(x_BxLxHxK: jax.Array, sign: int) -> jax.Array:
  """(-x2, x1) for sign 1, (x2, -x1) for sign -1, over each head's halves, in fp32: a +-1
  permutation matmul, exact (one term per output; bf16 in one MXU pass, wider inputs at HIGHEST
  precision), its fp32 output what the elementwise pass fuses into the matmul's."""
  H = x_BxLxHxK.shape[-1]
  half = H // 2
  swap_HxH = np.zeros((H, H), np.float32)
  swap_HxH[np.arange(half) + half, np.arange(half)] = -sign
  swap_HxH[np.arange(half), np.arange(half) + half] = sign
  precision = (jax.lax.Precision.DEFAULT if x_BxLxHxK.dtype == jnp.bfloat16
               else jax.lax.Precision.HIGHEST)
  return jnp.einsum("BLNH,HG->BLNG", x_BxLxHxK, swap_HxH.astype(x_BxLxHxK.dtype),
                    precision=precision, preferred_element_type=jnp.float32)


def _full_width(t_BxLxK2: jax.Array) -> jax.Array:
  return jnp.concatenate([t_BxLxK2, t_BxLxK2], axis=-1)[:, :, None, :]


def _halves_summed(t_BxLxNxH: jax.Array, shape) -> jax.Array:
  """A full-width table's cotangent back to the (B, L, H/2) table it was built from."""
  t_BxLxH = jnp.sum(t_BxLxNxH, axis=2)
  half = t_BxLxH.shape[-1] // 2
  t = t_BxLxH[..., :half] + t_BxLxH[..., half:]
  return jnp.sum(t, axis=tuple(i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1),
                 keepdims=True)


@jax.custom_vjp
def _rope_whole_heads(x_BxLxHxK: jax.Array, sin_BxLxK2, cos_BxLxK2) -> jax.Array:
  """apply_rope's products (x1 cos - x2 sin, x2 cos + x1 sin) written over whole heads:
  x cos + (-x2, x1) sin, the swap a matmul (_half_swap), then one elementwise pass. Why: on a TPU
  the split halves are 64 features wide at head dim 128, half a lane row each; XLA kept them as
  separate arrays through the step (RoPE and its gradient about 37 ms of the real student's
  545 ms train step, call 47's profile), where this form fuses into the swap's output (528 ms,
  chip call 53). The gradient is the split form's, dx = g cos + (g2, -g1) sin, by the same swap
  of the incoming bf16 cotangent (the sin table is the same on both halves), rounded once as the
  split form's; autodiff would swap an fp32 product instead, rounded to bf16 on the MXU (6 ms
  faster on the chip, 522 ms: the one rounding is kept). x is kept for the backward only where
  the tables' own gradients are asked for, as the split form, linear in x, keeps none. The
  matmuls add 2 x head_dim FLOPs per turned feature, which XLA counts and MFU does not
  (flops.rope_swap_flops)."""
  return _turned_whole_heads(x_BxLxHxK, sin_BxLxK2, cos_BxLxK2)


def _turned_whole_heads(x_BxLxHxK, sin_BxLxK2, cos_BxLxK2):
  x = x_BxLxHxK.astype(jnp.float32)
  swapped = _half_swap(x_BxLxHxK, 1)
  out = x * _full_width(cos_BxLxK2) + swapped * _full_width(sin_BxLxK2)
  return out.astype(x_BxLxHxK.dtype)


def _rope_whole_heads_fwd(x, sin, cos):
  out = _turned_whole_heads(x.value, sin.value, cos.value)
  tables_perturbed = sin.perturbed or cos.perturbed
  return out, (x.value if tables_perturbed else None, sin.value, cos.value)


def _rope_whole_heads_bwd(saved, g_BxLxHxK):
  x_BxLxHxK, sin_BxLxK2, cos_BxLxK2 = saved
  g = g_BxLxHxK.astype(jnp.float32)
  swapped = _half_swap(g_BxLxHxK, -1)
  dx = g * _full_width(cos_BxLxK2) + swapped * _full_width(sin_BxLxK2)
  dx = dx.astype(g_BxLxHxK.dtype)  # the output's dtype, x's
  if x_BxLxHxK is None:  # positions' tables, never differentiated in a step
    return dx, jnp.zeros_like(sin_BxLxK2), jnp.zeros_like(cos_BxLxK2)
  x = x_BxLxHxK.astype(jnp.float32)
  dcos = _halves_summed(g * x, cos_BxLxK2.shape)
  dsin = _halves_summed(g * _half_swap(x_BxLxHxK, 1), sin_BxLxK2.shape)
  return dx, dsin.astype(sin_BxLxK2.dtype), dcos.astype(cos_BxLxK2.dtype)


_rope_whole_heads.defvjp(_rope_whole_heads_fwd, _rope_whole_heads_bwd, symbolic_zeros=True)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  return x if cap is None else cap * jnp.tanh(x / cap)
