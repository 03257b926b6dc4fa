"""Weights stored as integer codes + scales: the frozen base of QLoRA.

`QuantizedWeight` replaces a weight's `nnx.Param` by a small module holding the codes and the
scales as `QuantizedValue` variables (not Params: no trainable filter ever selects them, and
they hold no optimizer state). Reading it (`w[...]`, as model code does) dequantizes, so any
code that reads weights still works. Codes and scales keep the weight's logical axes where their
dims match it (scales are replicated along reduced and tiled dims), so they shard like it.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.quant.fakequant import WeightQuant, dequantize, quantize_weight
from distillax.quant.graph import place_like


def scale_axes_map(scale_shape: Sequence[int], weight_shape: Sequence[int]) -> list[int | None]:
  """Scale dims as large as the weight's keep its placement; reduced and tiled dims do not."""
  return [i if s == d else None for i, (s, d) in enumerate(zip(scale_shape, weight_shape))]


class QuantizedValue(nnx.Variable):
  """Integer codes or scales of a frozen quantized weight (never trainable)."""


class QuantizedWeight(nnx.Module):
  """A frozen weight kept as codes + scales; `w[...]` gives it dequantized."""

  def __init__(self, qvalue: jax.Array, scale: jax.Array, *, qtype: str, logical_axes,
               dtype: Any):
    self.qvalue = QuantizedValue(qvalue, logical_axes=tuple(logical_axes))
    scale_logical = tuple(None if a is None else logical_axes[a]
                          for a in scale_axes_map(scale.shape, qvalue.shape))
    self.scale = QuantizedValue(scale, logical_axes=scale_logical)
    self.qtype = qtype
    self.param_dtype = jnp.dtype(dtype)  # dtype of the full-precision weight it replaces
    self.logical_axes = tuple(logical_axes)

  @classmethod
  def from_array(cls, w: jax.Array, wq: WeightQuant, *, logical_axes) -> "QuantizedWeight":
    """Quantizes `w` (codes placed like `w`, scales like its matching dims)."""
    qvalue, scale = jax.jit(quantize_weight, static_argnums=1)(w, wq)
    qvalue = place_like(qvalue, w, range(w.ndim))
    scale = place_like(scale, w, scale_axes_map(scale.shape, w.shape))
    return cls(qvalue, scale, qtype=wq.qtype, logical_axes=logical_axes, dtype=w.dtype)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.qvalue.shape)

  def dequantized(self) -> jax.Array:
    """The weight on its grid, in the compute dtype it was quantized in."""
    return dequantize(self.qvalue[...], self.scale[...], self.qtype)

  def __getitem__(self, index) -> jax.Array:
    return self.dequantized()[index]
