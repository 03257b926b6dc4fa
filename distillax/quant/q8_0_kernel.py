"""QAT's q8_0 activation rounding as one Pallas kernel on a TPU, in the array's own layout.

`ggml.fake_quantize_activation` cuts a matmul input into blocks of 32 along its minor axis and
rounds each block: (..., K) -> (..., K/32, 32). A TPU lays the minor axis over 128 lanes, so
that reshape is a relayout copy, and every elementwise step after it runs on a quarter-full
vector: the call-4 profile of q4_0 QAT KD on a v5e spends 135 of its 758 ms there, for
arrays the chip reads and writes in a few milliseconds. Here each tile of rows stays (rows, K)
in vector registers: a block's largest magnitude reaches its 32 lanes by five exchanges with
the lane 1, 2, 4, 8 and 16 away (a butterfly: after them every lane holds the maximum of its
aligned group of 32), then every lane rounds itself. The arithmetic is `ggml`'s, operation for
operation: 127 / amax as the multiplier (0 for an all-zero block), round to nearest even, the
scale amax / 127 rounded to float16 in integer arithmetic, their product in the input's dtype.
So the values are the same bits (tests/quant/test_q8_0_kernel.py: in interpret mode on a CPU,
and the Mosaic kernel on the chip against the XLA path).

Used for a minor-axis contraction of a multiple of 128 inputs, lowered for a TPU, where no
partitioning rules are active or their mesh is one device (a kernel the compiler cannot
partition; on a larger mesh the XLA path runs, as before).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from distillax import partitioning as pt

BLOCK = 32
LANES = 128
TILE_ELEMENTS = 128 * 1024  # elements per grid step: a few float32 copies fit VMEM
_F16_MIN_NORMAL = 2.0 ** -14


def applies(x: jax.Array, contract_axes) -> bool:
  """Whether the kernel takes this rounding: blocks along the minor axis only, whole lanes,
  and one device (or none) under the active rules."""
  last = x.ndim - 1
  if sorted(a % x.ndim for a in contract_axes) != [last] or x.shape[last] % LANES:
    return False
  active = pt.active_rules()
  return active is None or active.mesh.size == 1


def _f16_rounded_nonnegative(d):
  """A finite float32 d >= 0 rounded to the nearest float16 (ties to even; subnormals kept;
  past 65504, inf), as `ggml._f16_rounded` does for any sign, in int32 arithmetic."""
  bits = jax.lax.bitcast_convert_type(d, jnp.int32)
  rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
  normal = jax.lax.bitcast_convert_type(rounded, jnp.float32)
  normal = jnp.where(normal > 65504.0, jnp.inf, normal)
  subnormal = jnp.round(d * (2.0 ** 24)) * (2.0 ** -24)
  return jnp.where(d < _F16_MIN_NORMAL, subnormal, normal)


def _block_max(a):
  """Every lane's maximum over its aligned group of 32 lanes (a (rows, K) tile)."""
  lanes = a.shape[1]
  # Which rotation holds each lane's partner depends on the lane alone, so it is worked out
  # on one row and broadcast over the tile's rows: per element, each exchange is then two
  # rotations, a select and a max (worked out per element, the masks cost as much again).
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, lanes), 1)
  for step in (1, 2, 4, 8, 16):
    # Both rotations, and which lane each position then reads (rolled with them): the partner
    # lane ^ step is one of the two, whichever direction the rotation runs.
    ahead, behind = pltpu.roll(a, step, 1), pltpu.roll(a, lanes - step, 1)
    takes_ahead = pltpu.roll(lane, step, 1) == (lane ^ step)
    a = jnp.maximum(a, jnp.where(takes_ahead, ahead, behind))
  return a


def _kernel(x_ref, o_ref):
  x = x_ref[...].astype(jnp.float32)
  amax = _block_max(jnp.abs(x))
  zero = amax == 0.0
  multiplier = jnp.where(zero, 0.0, 127.0 / jnp.where(zero, 1.0, amax))
  codes = jnp.round(x * multiplier)  # to nearest even (Mosaic's roundeven)
  scale = _f16_rounded_nonnegative(amax / 127.0)
  o_ref[...] = (scale * codes).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "tile_rows"))
def fake_quantize_rows(x: jax.Array, interpret: bool = False,
                       tile_rows: int | None = None) -> jax.Array:
  """x (..., K) rounded to q8_0 blocks of 32 along K, in x's dtype (`applies` holds); rows
  `tile_rows` at a time (default: TILE_ELEMENTS worth, a multiple of bf16's 16 sublanes)."""
  rows_by_k = x.reshape(-1, x.shape[-1])
  n, k = rows_by_k.shape
  tile = min(n, tile_rows or max(16, TILE_ELEMENTS // k // 16 * 16))
  out = pl.pallas_call(
      _kernel, grid=(pl.cdiv(n, tile),),
      in_specs=[pl.BlockSpec((tile, k), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((tile, k), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((n, k), x.dtype), interpret=interpret)(rows_by_k)
  return out.reshape(x.shape)
