"""Weights stored as integer codes + scales: the frozen base of QLoRA.

`QuantizedWeight` replaces a weight's `nnx.Param` by a small module holding the codes and the
scales as `QuantizedValue` variables (not Params: no trainable filter ever selects them, and
they hold no optimizer state). Reading it (`w[...]`, as model code does) dequantizes, so any
code that reads weights still works. Codes and scales keep the weight's logical axes where their
dims match it (scales are replicated along reduced and tiled dims), so they shard like it.

4-bit codes (int4, nf4) are stored two per uint8 along the last axis (which keeps its logical
name at half the size): JAX's own int4/uint4 arrays lose their packed layout through
`device_put` on CPU and are then refused by compiled steps, and an int8 container would double
the memory QLoRA is meant to save. A weight with an odd last dim keeps one code per int8.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.quant.fakequant import WeightQuant, dequantize, quantize_weight
from distillax.quant.graph import place_like


_FOUR_BIT = ("int4", "nf4")


def pack_codes(qvalue: jax.Array, qtype: str) -> jax.Array:
  """int4 / uint4 codes -> uint8, element 2i of the last axis in the low nibble, 2i+1 high."""
  nibbles = (qvalue.astype(jnp.int8) & 0xF).astype(jnp.uint8)
  return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_codes(packed: jax.Array, qtype: str) -> jax.Array:
  """The inverse: int8 codes (int4 values, sign-extended) or uint8 nf4 indices."""
  pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
  codes = pairs.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
  if qtype == "int4":
    return (codes.astype(jnp.int8) ^ 8) - 8
  return codes


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_for_storage(w: jax.Array, wq: WeightQuant, packed: bool):
  qvalue, scale = quantize_weight(w, wq)
  if packed:
    return pack_codes(qvalue, wq.qtype), scale
  if wq.qtype in _FOUR_BIT:  # jnp int4/uint4 arrays do not survive device_put (see above)
    return qvalue.astype(jnp.uint8 if wq.qtype == "nf4" else jnp.int8), scale
  return qvalue, scale


def scale_axes_map(scale_shape: Sequence[int], weight_shape: Sequence[int]) -> list[int | None]:
  """Scale dims as large as the weight's keep its placement; reduced and tiled dims do not."""
  return [i if s == d else None for i, (s, d) in enumerate(zip(scale_shape, weight_shape))]


class QuantizedValue(nnx.Variable):
  """Integer codes or scales of a frozen quantized weight (never trainable)."""


class QuantizedWeight(nnx.Module):
  """A frozen weight kept as codes + scales; `w[...]` gives it dequantized."""

  def __init__(self, qvalue: jax.Array, scale: jax.Array, *, qtype: str, logical_axes,
               dtype: Any, packed: bool):
    """`qvalue` as stored (packed when `packed`), `scale` with the weight's rank."""
    self.qvalue = QuantizedValue(qvalue, logical_axes=tuple(logical_axes))
    self.packed = packed
    scale_logical = tuple(None if a is None else logical_axes[a]
                          for a in scale_axes_map(scale.shape, self.shape))
    self.scale = QuantizedValue(scale, logical_axes=scale_logical)
    self.qtype = qtype
    self.param_dtype = jnp.dtype(dtype)  # dtype of the full-precision weight it replaces
    self.logical_axes = tuple(logical_axes)

  @classmethod
  def from_array(cls, w: jax.Array, wq: WeightQuant, *, logical_axes) -> "QuantizedWeight":
    """Quantizes `w` (codes placed like `w`, scales like its matching dims)."""
    packed = wq.qtype in _FOUR_BIT and w.shape[-1] % 2 == 0
    qvalue, scale = _quantize_for_storage(w, wq, packed)
    qvalue = place_like(qvalue, w, range(w.ndim))
    scale = place_like(scale, w, scale_axes_map(scale.shape, w.shape))
    return cls(qvalue, scale, qtype=wq.qtype, logical_axes=logical_axes, dtype=w.dtype,
               packed=packed)

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the weight (not of the packed codes)."""
    shape = tuple(self.qvalue.shape)
    return shape[:-1] + (2 * shape[-1],) if self.packed else shape

  def codes(self) -> jax.Array:
    """One code per weight element (int8 / uint8 containers for 4-bit types)."""
    qvalue = self.qvalue[...]
    return unpack_codes(qvalue, self.qtype) if self.packed else qvalue

  def dequantized(self) -> jax.Array:
    """The weight on its grid, in the compute dtype it was quantized in."""
    return dequantize(self.codes(), self.scale[...], self.qtype)

  def __getitem__(self, index) -> jax.Array:
    return self.dequantized()[index]

  def stored(self) -> tuple[jax.Array, jax.Array]:
    """(codes as stored, scales): what `dequantizer` turns back into the weight."""
    return self.qvalue[...], self.scale[...]

  def dequantizer(self, dtype: Any) -> "Dequantizer":
    return Dequantizer(self.qtype, self.packed, jnp.dtype(dtype).name)


@dataclasses.dataclass(frozen=True)
class Dequantizer:
  """(stored codes, scales) -> the weight in `dtype`: `w.dequantized().astype(dtype)` as a
  pure function of the stored arrays, so a matmul can dequantize again in its backward."""

  qtype: str
  packed: bool
  dtype: str

  def __call__(self, qvalue: jax.Array, scale: jax.Array,
               zero: jax.Array | None = None) -> jax.Array:
    """`zero` (an exact 0 broadcastable to the weight, known only in the backward) is added to
    the codes: the weight is the same, but a backward dequantizing again cannot be scheduled
    before it is needed, which would keep every layer's full-precision weight alive at once."""
    codes = unpack_codes(qvalue, self.qtype) if self.packed else qvalue
    if zero is not None:
      codes = codes + zero.astype(codes.dtype)
    return dequantize(codes, scale, self.qtype).astype(self.dtype)
