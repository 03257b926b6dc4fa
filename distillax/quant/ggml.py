"""llama.cpp's q8_0 and q4_0 block formats in JAX, rounding exactly as ggml rounds.

QAT is worth its cost only when the fake-quant forward rounds as the deployment kernel does, so
these are not "an int8 / int4 grid" but ggml's own blocks, number for number:

  q8_0  blocks of 32 along the contracted (input) axis; d = amax / 127 as an fp16 scale;
        codes roundf(x * (1 / d)) (halves away from zero), value = d * code.
  q4_0  blocks of 32; d = m / -8 where m is the block's first element of largest magnitude
        (sign kept, so that element lands on code 0 = -8 d); codes
        min(15, trunc(x * (1 / d) + 8.5)), value = d * (code - 8).

Both follow ggml's reference quantizers (`quantize_row_q8_0_ref` / `quantize_row_q4_0_ref`,
mirrored by `gguf.quants`), which is how GGUF files are made; the arithmetic is float32 step by
step in the same order, so `dequantize(quantize(w))` here equals `gguf.quants.dequantize(
gguf.quants.quantize(w))` bit for bit (tests/quant/test_ggml_rounding.py, against a numpy
transcription that tests/quant/test_ggml.py pins to gguf's; a TPU's by scripts/chip_tests.sh).
The scale used for rounding is the float32 d; the one stored (and multiplied back) is d rounded
to fp16, as in ggml.

Activations ("q8_0" as an act_qtype): llama.cpp's CPU kernels multiply q4_0 / q8_0 weights by
inputs quantized to q8_0 blocks along the same contracted axis. Its x86 quantizer
(`quantize_row_q8_0`, AVX2) differs from the reference in two details we copy: the multiplier is
127 / amax (not 1 / d) and the rounding is to nearest even.

Layout: the contracted axes are taken in increasing order and flattened row-major into one
input axis, then cut into blocks of 32: exactly how a GGUF tensor of shape [out, in] stores the
weight (in = ne0, the innermost axis), e.g. attention's output weight (heads, head_dim, embed)
is the GGUF row-major [embed, heads * head_dim]. The activation of the same matmul is blocked the
same way, which holds because our einsums list contracted axes in the same order in both
operands.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distillax.errors import UserError
from distillax.quant import q8_0_kernel

BLOCK = 32
WEIGHT_QTYPES = ("q8_0", "q4_0")
ACT_QTYPES = ("q8_0",)
# Bytes of one block as stored in a GGUF file: fp16 scale + codes (q4_0: two per byte).
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}


def _roundf(x: jnp.ndarray) -> jnp.ndarray:
  """C's roundf (halves away from zero), as gguf.quants.np_roundf computes it: exact in f32."""
  a = jnp.abs(x)
  floored = jnp.floor(a)
  return jnp.sign(x) * (floored + jnp.floor(2 * (a - floored)))


def _reciprocal(d: jnp.ndarray) -> jnp.ndarray:
  return jnp.where(d == 0, jnp.float32(0), jnp.float32(1) / jnp.where(d == 0, 1, d))


_F16_MIN_NORMAL = 2.0 ** -14


def _f16_rounded(x: jnp.ndarray) -> jnp.ndarray:
  """float32 `x` rounded to the nearest float16 (ties to even, subnormals kept, overflow to
  inf), as float32, in integer and power-of-two arithmetic. `x.astype(float16)` cannot be
  trusted for this inside a jitted function: the TPU compiler folds a float32 -> float16 ->
  float32 round trip away (measured on a v5e: the scales came back unrounded, so 20 of 21
  q4_0 blocks differed from ggml's), while every operation here is exact on every backend."""
  x = x.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  keep_lsb = (bits >> 13) & 1  # the 10-bit mantissa's last bit: ties go to even
  normal = jax.lax.bitcast_convert_type(((bits + 0xFFF + keep_lsb) & ~np.uint32(0x1FFF))
                                        .astype(jnp.uint32), jnp.float32)
  normal = jnp.where(jnp.abs(normal) > 65504.0, jnp.copysign(jnp.inf, x), normal)
  # Below the smallest normal float16 the grid is 2^-24 apart: an exact scaling, then rint.
  subnormal = jnp.round(x * jnp.float32(2.0 ** 24)) * jnp.float32(2.0 ** -24)
  rounded = jnp.where(jnp.abs(x) < _F16_MIN_NORMAL, subnormal, normal)
  return jnp.where(jnp.isfinite(x), rounded, x)


def quantize_blocks(blocks: jnp.ndarray, qtype: str) -> tuple[jnp.ndarray, jnp.ndarray]:
  """float32 (..., 32) blocks -> (codes (..., 32) int8 for q8_0 / uint8 0..15 for q4_0,
  fp16 scales (..., 1)), as ggml's reference quantizer writes them."""
  blocks = blocks.astype(jnp.float32)
  if qtype == "q8_0":
    d = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / jnp.float32(127)
    codes = _roundf(blocks * _reciprocal(d)).astype(jnp.int8)
  elif qtype == "q4_0":
    first_largest = jnp.argmax(jnp.abs(blocks), axis=-1)[..., None]
    d = jnp.take_along_axis(blocks, first_largest, axis=-1) / jnp.float32(-8)
    shifted = jnp.trunc(blocks * _reciprocal(d) + jnp.float32(8.5))
    codes = jnp.clip(shifted, 0, 15).astype(jnp.uint8)
  else:
    raise UserError(f"{qtype!r} is not a ggml block type; use one of {', '.join(WEIGHT_QTYPES)}")
  return codes, _f16_rounded(d).astype(jnp.float16)


def dequantize_blocks(codes: jnp.ndarray, scales: jnp.ndarray, qtype: str) -> jnp.ndarray:
  """The float32 values of ggml blocks: fp16 scale times the (centred) code, exact in f32."""
  centred = codes.astype(jnp.float32) - (8.0 if qtype == "q4_0" else 0.0)
  return scales.astype(jnp.float32) * centred


def quantize_activation_blocks(blocks: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """q8_0 as llama.cpp's x86 CPU kernels quantize matmul inputs: 127 / amax, nearest even."""
  blocks = blocks.astype(jnp.float32)
  amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
  d = amax / jnp.float32(127)
  multiplier = jnp.where(amax == 0, jnp.float32(0),
                         jnp.float32(127) / jnp.where(amax == 0, 1, amax))
  return jnp.round(blocks * multiplier).astype(jnp.int8), _f16_rounded(d).astype(jnp.float16)


# ---- arrays of any rank: blocks along the contracted axes ------------------------------------

def _to_rows(x: jnp.ndarray, contract_axes: Sequence[int], what: str):
  """x with its contracted axes (increasing order) moved last and flattened, cut into blocks
  of 32: (..., n_blocks, 32), plus what `_from_rows` needs to undo it."""
  contract = sorted(a % x.ndim for a in contract_axes)
  if not contract:
    raise UserError(f"{what} contracts no axis; ggml blocks run along the contracted axis")
  free = [a for a in range(x.ndim) if a not in contract]
  moved = jnp.transpose(x, free + contract)
  n = int(np.prod([x.shape[a] for a in contract]))
  if n % BLOCK:
    raise UserError(f"{what} of shape {tuple(x.shape)} contracts {n} inputs (axes {contract}), "
                    f"not a multiple of {BLOCK}; ggml's q8_0/q4_0 need whole blocks of {BLOCK} "
                    f"(exempt this module with a rule whose weight_qtype is None)")
  rows = moved.reshape(moved.shape[:len(free)] + (n // BLOCK, BLOCK))
  return rows, (moved.shape, free + contract)


def _from_rows(rows: jnp.ndarray, layout) -> jnp.ndarray:
  moved_shape, order = layout
  return jnp.transpose(rows.reshape(moved_shape), np.argsort(order))


def quantize(w: jnp.ndarray, qtype: str, contract_axes: Sequence[int]
             ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(codes (free..., n_blocks, 32), fp16 scales (free..., n_blocks, 1)) of a weight whose
  matmul contracts `contract_axes`: the blocks a GGUF [out, in] tensor stores, in row order."""
  rows, _ = _to_rows(w, contract_axes, f"{qtype} weight")
  return quantize_blocks(rows, qtype)


def fake_quantize(w: jnp.ndarray, qtype: str, contract_axes: Sequence[int]) -> jnp.ndarray:
  """The weight rounded to its ggml blocks, in its own dtype (exact for float32).

  Where the contracted axes are consecutive (every weight of our models), the blocks are cut
  where they lie (`_blocks_in_place`) and rounded by `_rounded_in_place`: the same numbers as
  `quantize_blocks` then `dequantize_blocks` on GGUF's rows, without moving the contracted
  axes last (a transpose of the whole weight, then blocks of 32 along the minor axis, which a
  TPU pads to its 128 lanes) and without q4_0's gather of each block's first largest element.
  """
  in_place = _blocks_in_place(w, contract_axes)
  if in_place is not None:
    blocks, axis = in_place
    return _rounded_in_place(blocks, qtype, axis).reshape(w.shape).astype(w.dtype)
  rows, layout = _to_rows(w, contract_axes, f"{qtype} weight")
  values = dequantize_blocks(*quantize_blocks(rows, qtype), qtype)
  return _from_rows(values, layout).astype(w.dtype)


def _blocks_in_place(x: jnp.ndarray, contract_axes: Sequence[int]):
  """(x reshaped to (..., n_blocks, 32, ...) where its contracted axes were, the block axis)
  when those axes are consecutive: row-major flattening of consecutive axes is a reshape, so
  the blocks are GGUF's. None otherwise, or when they do not hold whole blocks (`_to_rows`
  says why)."""
  contract = sorted(a % x.ndim for a in contract_axes)
  if not contract or contract != list(range(contract[0], contract[-1] + 1)):
    return None
  n = int(np.prod([x.shape[a] for a in contract]))
  if n % BLOCK:
    return None
  shape = x.shape[:contract[0]] + (n // BLOCK, BLOCK) + x.shape[contract[-1] + 1:]
  return x.reshape(shape), contract[0] + 1


def _rounded_in_place(blocks: jnp.ndarray, qtype: str, axis: int) -> jnp.ndarray:
  """float32 values of the ggml blocks running along `axis`: `quantize_blocks` and
  `dequantize_blocks`, step for step in float32. q4_0's first element of largest magnitude is
  picked by reductions: the first index where |x| is the block's max, then a sum of the block
  with every other element replaced by -0.0 (x + -0.0 is x exactly, the sign of a zero kept)."""
  blocks = blocks.astype(jnp.float32)
  magnitude = jnp.abs(blocks)
  amax = jnp.max(magnitude, axis=axis, keepdims=True)
  if qtype == "q8_0":
    d = amax / jnp.float32(127)
    codes = _roundf(blocks * _reciprocal(d)).astype(jnp.int8).astype(jnp.float32)  # -0 -> 0
  elif qtype == "q4_0":
    index = jax.lax.broadcasted_iota(jnp.int32, blocks.shape, axis)
    first = jnp.min(jnp.where(magnitude == amax, index, BLOCK), axis=axis, keepdims=True)
    m = jnp.sum(jnp.where(index == first, blocks, jnp.float32(-0.0)), axis=axis, keepdims=True)
    d = m / jnp.float32(-8)
    codes = jnp.clip(jnp.trunc(blocks * _reciprocal(d) + jnp.float32(8.5)), 0, 15) - 8.0
  else:
    raise UserError(f"{qtype!r} is not a ggml block type; use one of {', '.join(WEIGHT_QTYPES)}")
  return _f16_rounded(d) * codes


def fake_quantize_activation(x: jnp.ndarray, qtype: str,
                             contract_axes: Sequence[int]) -> jnp.ndarray:
  """A matmul input rounded to q8_0 blocks along its contracted axes, as the CPU kernel does."""
  if qtype not in ACT_QTYPES:
    raise UserError(f"{qtype!r} is not a ggml activation type; use one of {', '.join(ACT_QTYPES)}")
  in_blocks = lambda x: activation_in_blocks(x, contract_axes)
  contract = sorted(a % x.ndim for a in contract_axes)
  if contract == list(range(x.ndim - len(contract), x.ndim)) and x.shape[-1] % BLOCK == 0:
    # Trailing axes flattened in order: each block of 32 lies in one row of the last axis
    # (attention's output input: heads x head_dim), the blocks of that axis alone.
    contract = [x.ndim - 1]
  if not q8_0_kernel.applies(x, contract):
    return in_blocks(x)
  # A TPU rounds in the array's own layout (quant/q8_0_kernel.py: the same bits); elsewhere
  # the blocks are cut by a reshape. Chosen where the program is lowered.
  return jax.lax.platform_dependent(x, tpu=q8_0_kernel.fake_quantize_rows, default=in_blocks)


def activation_in_blocks(x: jnp.ndarray, contract_axes: Sequence[int]) -> jnp.ndarray:
  """The q8_0 rounding with the blocks cut by a reshape (..., n_blocks, 32), on any backend."""
  rows, layout = _to_rows(x, contract_axes, "q8_0 activation")
  values = dequantize_blocks(*quantize_activation_blocks(rows), "q8_0")
  return _from_rows(values, layout).astype(x.dtype)


# ---- the bytes of a GGUF tensor ----------------------------------------------------------------

def pack_blocks(codes: np.ndarray, scales: np.ndarray, qtype: str) -> np.ndarray:
  """ggml's block bytes, uint8 (..., n_blocks * BLOCK_BYTES): per block the fp16 scale (little
  endian), then the codes; q4_0 puts element j in the low nibble of byte j, j + 16 in the high."""
  codes, scales = np.asarray(codes), np.asarray(scales, np.float16)
  d = scales.astype("<f2").view(np.uint8)  # (..., n_blocks, 2)
  if qtype == "q8_0":
    qs = codes.astype(np.int8).view(np.uint8)
  else:
    qs = (codes[..., :BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)).astype(np.uint8)
  blocks = np.concatenate([d, qs], axis=-1)
  return np.ascontiguousarray(blocks.reshape(blocks.shape[:-2] + (-1,)))
