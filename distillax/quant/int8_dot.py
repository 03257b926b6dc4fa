"""Real int8 matmuls for a frozen model: int8 x int8 -> int32 dots, rescaled once.

A weight is kept as int8 codes with one float32 scale per output channel; the input of each of
its matmuls is quantized per token when the matmul runs (one scale per index of its axes that
are not contracted, i.e. per row). Both use the grid of qwix's int8 (so of PTQ and QAT here):

    scale = max|v| / 127.5 over the contracted axes, codes = clip(round(v / scale), -128, 127)

The codes are multiplied exactly in int32 (XLA emits an s8 x s8 -> s32 dot: the MXU's int8
rate on TPU), and the product is rescaled in float32, y = acc * scale_x * scale_w, then cast
to the dtype the model's own matmul gives. `MAX_CONTRACTION` products of two codes fit int32.

Divisions by a scale are written as multiplications by its reciprocal (what XLA does to them
anyway): a numpy reference then reproduces every code and every output bit.
"""

from __future__ import annotations

import string
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distillax.errors import UserError

BOUND = 127.5  # qwix's symmetric int8 bound: absmax lands on the edge of the last bucket
MAX_CONTRACTION = (2**31 - 1) // (128 * 128)  # contracted elements an int32 sum always holds
_TINY = float(np.sqrt(np.finfo(np.float32).tiny))  # scales below this are all-zero rows


def quantize_int8(v: jax.Array, reduce_axes: Sequence[int]) -> tuple[jax.Array, jax.Array]:
  """(int8 codes, float32 scales with `v`'s rank, 1 on the reduced axes)."""
  v = v.astype(jnp.float32)
  absmax = jnp.max(jnp.abs(v), axis=tuple(reduce_axes), keepdims=True)
  scale = absmax * np.float32(1.0 / BOUND)
  scale = jnp.where(scale < _TINY, jnp.float32(1.0), scale)  # a zero row: codes 0 anyway
  codes = jnp.clip(jnp.round(v * (np.float32(1.0) / scale)), -128, 127)
  return codes.astype(jnp.int8), scale


def dequantize_int8(codes: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  return (codes.astype(jnp.float32) * scale).astype(dtype)


# ---- training through the int8 path is refused --------------------------------------------------

@jax.custom_vjp
def frozen_input(x: jax.Array) -> jax.Array:
  """The identity; differentiating through it (a model of int8 weights being trained, or a
  gradient asked through its matmuls) is refused: rounding has no useful gradient."""
  return x


def _frozen_fwd(x):
  return x, None


def _frozen_bwd(_, g):
  raise UserError("a gradient reached an int8 model's matmul (teacher.int8): its weights are "
                  "frozen integer codes and cannot be trained; train a full-precision model, "
                  "or fake-quantize one with the qat section")


frozen_input.defvjp(_frozen_fwd, _frozen_bwd)


# ---- scales onto the output --------------------------------------------------------------------

def onto_output(scale: jax.Array, contracted: Sequence[int], out_positions: Sequence[int],
                out_ndim: int) -> jax.Array:
  """`scale` (an operand's, 1 on its `contracted` axes) laid out to broadcast against the
  output: its other axes, in order, land on `out_positions`; the rest of the output gets 1."""
  kept = [i for i in range(scale.ndim) if i not in contracted]
  squeezed = jnp.reshape(scale, [scale.shape[i] for i in kept])
  order = sorted(range(len(kept)), key=lambda j: out_positions[j])
  moved = jnp.transpose(squeezed, order)
  shape = [1] * out_ndim
  for j in order:
    shape[out_positions[j]] = squeezed.shape[j]
  return jnp.reshape(moved, shape)


def rescale(acc: jax.Array, x_scale: jax.Array, w_scale: jax.Array, dtype) -> jax.Array:
  """acc * scale_x * scale_w in float32 (this order: the numpy reference's), then `dtype`."""
  return ((acc.astype(jnp.float32) * x_scale) * w_scale).astype(dtype)


# ---- einsum ------------------------------------------------------------------------------------

def explicit_terms(spec: str, ndims: Sequence[int]) -> tuple[list[str], str] | None:
  """The einsum's operand and output terms with '...' spelled in fresh letters; None where
  both operands carry '...' (no model matmul of a weight does)."""
  spec = spec.replace(" ", "")
  if "->" not in spec:
    return None
  ins, out = spec.split("->")
  terms = ins.split(",")
  dotted = [i for i, t in enumerate(terms) if "..." in t]
  if len(terms) != 2 or len(dotted) > 1:
    return None
  if dotted:
    i = dotted[0]
    fresh = "".join(c for c in string.ascii_letters if c not in spec)
    dots = fresh[:ndims[i] - (len(terms[i]) - 3)]
    terms[i], out = terms[i].replace("...", dots), out.replace("...", dots)
  return terms, out


def int8_einsum(terms: Sequence[str], out: str, x: jax.Array, x_index: int, w_codes: jax.Array,
                w_scale: jax.Array, dtype, kwargs: dict) -> jax.Array:
  """`einsum(terms -> out)` of x (at `x_index`) and the weight given by its codes and scales,
  through an int8 x int8 -> int32 product; the result in `dtype`."""
  x_term, w_term = terms[x_index], terms[1 - x_index]
  contracted = [c for c in x_term if c in w_term and c not in out]
  x_codes, x_scale = quantize_int8(frozen_input(x), [x_term.index(c) for c in contracted])
  operands = [None, None]
  operands[x_index], operands[1 - x_index] = x_codes, w_codes
  rest = {k: v for k, v in kwargs.items() if k not in ("precision", "preferred_element_type")}
  acc = jnp.einsum(f"{terms[0]},{terms[1]}->{out}", *operands,
                   preferred_element_type=jnp.int32, **rest)

  def laid_out(scale, term):
    skip = [term.index(c) for c in contracted]
    return onto_output(scale, skip, [out.index(c) for c in term if c not in contracted],
                       len(out))
  return rescale(acc, laid_out(x_scale, x_term), laid_out(w_scale, w_term), dtype)


# ---- dot_general -------------------------------------------------------------------------------

def int8_dot_general(x: jax.Array, x_side: int, w_codes: jax.Array, w_scale: jax.Array,
                     dimension_numbers, dtype, kwargs: dict) -> jax.Array:
  """`lax.dot_general` of x (lhs when x_side is 0) and the int8 weight; the result in `dtype`."""
  (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers
  contract = (list(contract_l), list(contract_r))
  batch = (list(batch_l), list(batch_r))
  x_codes, x_scale = quantize_int8(frozen_input(x), contract[x_side])
  lhs, rhs = (x_codes, w_codes) if x_side == 0 else (w_codes, x_codes)
  rest = {k: v for k, v in kwargs.items() if k not in ("precision", "preferred_element_type")}
  acc = jax.lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.int32,
                            **rest)
  # Output axes: batch, then lhs's free axes, then rhs's free axes (each in operand order).
  free = [[i for i in range(op.ndim) if i not in contract[s] + batch[s]]
          for s, op in enumerate((lhs, rhs))]
  nb = len(batch[0])

  def positions(side):
    where = {a: k for k, a in enumerate(batch[side])}
    start = nb + (0 if side == 0 else len(free[0]))
    where.update({a: start + k for k, a in enumerate(free[side])})
    ndim = (lhs, rhs)[side].ndim
    return [where[a] for a in range(ndim) if a not in contract[side]]

  out_ndim = acc.ndim
  sx = onto_output(x_scale, contract[x_side], positions(x_side), out_ndim)
  sw = onto_output(w_scale, contract[1 - x_side], positions(1 - x_side), out_ndim)
  return rescale(acc, sx, sw, dtype)


# ---- grouped (ragged) matmul -------------------------------------------------------------------

def int8_ragged_dot(x_MxK: jax.Array, w_codes_GxKxN: jax.Array, w_scale_Gx1xN: jax.Array,
                    group_sizes_G: jax.Array, dtype, kwargs: dict) -> jax.Array:
  """`lax.ragged_dot`: rows of group g (consecutive, `group_sizes_G`) times expert g's int8
  matrix; row m's output is rescaled by its own scale and its group's channel scales."""
  x_codes, x_scale_Mx1 = quantize_int8(frozen_input(x_MxK), (1,))
  rest = {k: v for k, v in kwargs.items() if k not in ("precision", "preferred_element_type")}
  acc_MxN = jax.lax.ragged_dot(x_codes, w_codes_GxKxN, group_sizes_G,
                               preferred_element_type=jnp.int32, **rest)
  M, G = x_MxK.shape[0], w_codes_GxKxN.shape[0]
  ends_G = jnp.cumsum(group_sizes_G)
  group_M = jnp.minimum(jnp.searchsorted(ends_G, jnp.arange(M), side="right"), G - 1)
  w_scale_MxN = jnp.take(w_scale_Gx1xN[:, 0, :], group_M, axis=0)
  return rescale(acc_MxN, x_scale_Mx1, w_scale_MxN, dtype)

