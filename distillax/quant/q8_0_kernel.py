"""QAT's q8_0 activation rounding as one Pallas kernel on a TPU, in the array's own layout.

`ggml.fake_quantize_activation` cuts a matmul input into blocks of 32 along its minor axis and
rounds each block: (..., K) -> (..., K/32, 32). A TPU lays the minor axis over 128 lanes, so
that reshape is a relayout copy, and every elementwise step after it runs on a quarter-full
vector: the call-4 profile of q4_0 QAT KD on a v5e spends 135 of its 758 ms there, for
arrays the chip reads and writes in a few milliseconds. Here each tile of rows is read as it
lies, (rows, K), in one of two forms (`KERNEL`):

- 'transposed' (the default): each chunk of 128 lanes is turned so that K runs down the
  sublanes. A block of 32 is then 4 whole vectors: its largest magnitude is an elementwise max
  and a max down the sublanes, and the block's multiplier and scale are worked out once per
  block instead of once per element.
- 'lanes': a block's largest magnitude reaches its 32 lanes by five exchanges with the lane
  1, 2, 4, 8 and 16 away (a butterfly: after them every lane holds the maximum of its aligned
  group of 32), then every lane rounds itself. On the chip this was ~39 ms per pass of the
  q4_0 QAT KD step at 4 x 2048 (call 28).

The arithmetic is `ggml`'s, operation for operation: 127 / amax as the multiplier (0 for an
all-zero block), round to nearest even, the scale amax / 127 rounded to float16 in integer
arithmetic, their product in the input's dtype. So the values are the same bits
(tests/quant/test_q8_0_kernel.py: both forms in interpret mode on a CPU, and as Mosaic kernels
on the chip against the XLA path).

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
  # Which rotation holds each lane's partner depends on the lane alone: worked out on one row
  # and broadcast over the tile's rows (on the chip no faster than on the whole tile, whose
  # identical rows the compiler already shared: call 29).
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
  o_ref[...] = _rounded(x, _block_max(jnp.abs(x))).astype(o_ref.dtype)


def _rounded(x, amax):
  """x rounded on the grid of its block's largest magnitude amax (broadcast against x)."""
  zero = amax == 0.0
  multiplier = jnp.where(zero, 0.0, 127.0 / jnp.where(zero, 1.0, amax))
  scale = _f16_rounded_nonnegative(amax / 127.0)
  return scale * jnp.round(x * multiplier)  # to nearest even (Mosaic's roundeven)


def _transposed_kernel(x_ref, o_ref):
  """The tile a lane chunk at a time, turned so that K runs down the sublanes: a block of 32
  is then 4 whole vectors, its largest magnitude an elementwise max and a max down the
  sublanes (no lane rotations), and the block's multiplier and float16 scale (two divisions
  and the float16 rounding, most of the arithmetic) are worked out once per block rather than
  once per element. The same operations on the same values as `_kernel`: the same bits."""
  for chunk in range(x_ref.shape[1] // LANES):
    lanes = slice(chunk * LANES, (chunk + 1) * LANES)
    x_t = x_ref[:, lanes].astype(jnp.float32).T  # (128 of K, rows)
    blocks = []
    for b in range(LANES // BLOCK):
      x_b = x_t[b * BLOCK:(b + 1) * BLOCK]
      blocks.append(_rounded(x_b, jnp.max(jnp.abs(x_b), axis=0, keepdims=True)))
    o_ref[:, lanes] = jnp.concatenate(blocks, axis=0).T.astype(o_ref.dtype)


# Which kernel fake_quantize_rows runs: 'transposed' (`_transposed_kernel`) or 'lanes'
# (`_kernel`, blocks along the lanes). benchmarks/lib/lever_grid.py's q8_0_kernel=NAME
# traces a step with either, to hold the two against each other on a chip.
KERNEL = "transposed"


def fake_quantize_rows(x: jax.Array, interpret: bool = False,
                       tile_rows: int | None = None, kernel: str | None = None) -> jax.Array:
  """x (..., K) rounded to q8_0 blocks of 32 along K, in x's dtype (`applies` holds); rows
  `tile_rows` at a time (default: TILE_ELEMENTS worth, a multiple of bf16's 16 sublanes; the
  transposed kernel turns whole lane chunks of them: a multiple of 128 rows). `kernel`:
  KERNEL's when None, read when the caller is traced."""
  return _fake_quantize_rows(x, interpret, tile_rows, kernel or KERNEL)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _fake_quantize_rows(x, interpret, tile_rows, kernel):
  rows_by_k = x.reshape(-1, x.shape[-1])
  n, k = rows_by_k.shape
  if n < LANES:  # fewer rows than one turned chunk
    kernel = "lanes"
  multiple = LANES if kernel == "transposed" else 16
  tile = tile_rows or max(multiple, TILE_ELEMENTS // k // multiple * multiple)
  # A tile no taller than the array: all of it (lanes), or whole turned chunks (transposed).
  tile = min(tile, n) if kernel == "lanes" else min(tile, n // LANES * LANES)
  body = {"lanes": _kernel, "transposed": _transposed_kernel}[kernel]
  out = pl.pallas_call(
      body, grid=(pl.cdiv(n, tile),),
      in_specs=[pl.BlockSpec((tile, k), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((tile, k), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((n, k), x.dtype), interpret=interpret)(rows_by_k)
  return out.reshape(x.shape)
