"""int8 QAT whose forward matmuls run as int8 x int8 -> int32 dots (`QuantConfig.int8_matmul`).

The fake-quant forward of an int8 rule (`(".*", "int8", "int8", None)`: weights per output
channel, activations per token) multiplies two arrays that are already on integer grids, in
the compute dtype. Here the same grids are multiplied as what they are: int8 codes, an
s8 x s8 -> s32 dot (the MXU's int8 rate on a TPU, twice its bf16 rate), rescaled once in
float32 by the token's and the channel's scales (`int8_dot`, the int8 teacher's arithmetic),
then cast to the compute dtype. The products and their sum are exact in int32, so the forward
is the fake-quant one up to the float32 rounding of a sum the bf16 matmul rounds differently.

The grid is `int8_dot.quantize_int8`'s (qwix's int8: absmax / 127.5, round to nearest,
clip to [-128, 127]; a multiplication by the scale's reciprocal where qwix divides, which moves
a value that lands exactly on a half-way point).

Backward: straight through both roundings, as fake-quant QAT: the cotangent of y = xq @ wq
(xq, wq the dequantized grids, computed again from x and w in the backward rather than kept)
is passed to x and w unchanged, dx = g @ wq^T and dw = xq^T @ g in the compute dtype. So the
gradient that reaches the float32 master weight is the fake-quant model's, and only the
forward (and the remat's recompute of it) runs at the int8 rate.

With `int8_backward` (`QuantConfig.int8_backward`) the two backward matmuls run in int8 too,
as MaxText's int8 training (AQT's fully quantized config) does, so every matmul of the step
takes the MXU's int8 rate. The straight-through gradients above are rounded once more:
  dx = g @ wq^T: wq is the weight's codes times its channel scales, so the channel scales go
     into g (g * s_w) and that is rounded per token, the grid of x; its codes multiply the
     weight's codes and the token's scale rescales the int32 sum. The weight's grid is exact.
  dw = xq^T @ g: xq is the input's codes times its token scales, so those go into g (g * s_x)
     and that is rounded per output channel over the tokens, the grid of w; its codes
     multiply the input's codes (exact) over the tokens. Past `MAX_CONTRACTION` tokens an
     int32 sum could overflow and dw stays in the compute dtype.
Each rounding moves a value by at most half its row's or channel's step (|v| max / 255), so
the gradients differ from the straight-through ones by about that, not by a bias that grows:
rounding is to nearest, as the forward's.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from distillax.quant.int8_dot import (MAX_CONTRACTION, dequantize_int8, explicit_terms,
                                      onto_output, quantize_int8)


def _contracted(x_term: str, w_term: str, out: str) -> list[str]:
  return [c for c in x_term if c in w_term and c not in out]


def _grids(x_term, w_term, out, x, w):
  """(x codes, x scales, w codes, w scales): x per index of its kept axes (a token), w per
  output channel (reduced over the contracted axes)."""
  contracted = _contracted(x_term, w_term, out)
  x_codes, x_scale = quantize_int8(x, [x_term.index(c) for c in contracted])
  w_codes, w_scale = quantize_int8(w, [w_term.index(c) for c in contracted])
  return x_codes, x_scale, w_codes, w_scale


def _forward(terms, out, x_index, out_dtype, x, w):
  x_term, w_term = terms[x_index], terms[1 - x_index]
  x_codes, x_scale, w_codes, w_scale = _grids(x_term, w_term, out, x, w)
  operands = [None, None]
  operands[x_index], operands[1 - x_index] = x_codes, w_codes
  acc = jnp.einsum(f"{terms[0]},{terms[1]}->{out}", *operands,
                   preferred_element_type=jnp.int32)
  contracted = _contracted(x_term, w_term, out)

  def laid_out(scale, term):
    skip = [term.index(c) for c in contracted]
    return onto_output(scale, skip, [out.index(c) for c in term if c not in contracted],
                       len(out))
  y = (acc.astype(jnp.float32) * laid_out(x_scale, x_term)) * laid_out(w_scale, w_term)
  return y.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def int8_trained_einsum(terms: tuple[str, str], out: str, x_index: int, out_dtype: str,
                        int8_backward: bool, x: jax.Array, w: jax.Array) -> jax.Array:
  """`einsum(terms -> out)` of x (operand `x_index`) and the weight w, both rounded to int8
  (x per token, w per output channel), multiplied in int8, given in `out_dtype`;
  straight-through backward, its two matmuls in int8 too with `int8_backward`."""
  return _forward(terms, out, x_index, out_dtype, x, w)


def _fwd(terms, out, x_index, out_dtype, int8_backward, x, w):
  return _forward(terms, out, x_index, out_dtype, x, w), (x, w)


def _bwd(terms, out, x_index, out_dtype, int8_backward, res, g):
  del out_dtype
  x, w = res
  if int8_backward:
    return _int8_grads(terms[x_index], terms[1 - x_index], out, x, w, g)
  x_term, w_term = terms[x_index], terms[1 - x_index]
  x_codes, x_scale, w_codes, w_scale = _grids(x_term, w_term, out, x, w)
  xq, wq = dequantize_int8(x_codes, x_scale, x.dtype), dequantize_int8(w_codes, w_scale, w.dtype)
  spec = f"{terms[0]},{terms[1]}->{out}"
  ordered = lambda a, b: (a, b) if x_index == 0 else (b, a)
  _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, *ordered(a, b)), xq, wq)
  g_x, g_w = vjp(g.astype(jnp.result_type(xq.dtype, wq.dtype)))
  return g_x.astype(x.dtype), g_w.astype(w.dtype)


int8_trained_einsum.defvjp(_fwd, _bwd)


def _scale_onto(scale: jax.Array, term: str, reduced: list[str], target: str) -> jax.Array:
  """A scale laid out over `term` (1 on its `reduced` letters) moved onto `target`'s axes."""
  kept = [c for c in term if c not in reduced]
  return onto_output(scale, [term.index(c) for c in reduced], [target.index(c) for c in kept],
                     len(target))


def _int8_grads(x_term: str, w_term: str, out: str, x, w, g):
  """(dx, dw) of the int8 product with both backward matmuls in int8 (module docstring)."""
  x_codes, x_scale, w_codes, w_scale = _grids(x_term, w_term, out, x, w)
  contracted = _contracted(x_term, w_term, out)
  tokens = [c for c in out if c in x_term and c not in w_term]  # x's own kept axes
  channels = [c for c in out if c in w_term and c not in x_term]  # w's own kept axes
  g = g.astype(jnp.float32)
  g_w, g_w_scale = quantize_int8(g * _scale_onto(w_scale, w_term, contracted, out),
                                 [out.index(c) for c in channels])  # per token
  acc = jnp.einsum(f"{out},{w_term}->{x_term}", g_w, w_codes, preferred_element_type=jnp.int32)
  dx = acc.astype(jnp.float32) * _scale_onto(g_w_scale, out, channels, x_term)
  g_x = g * _scale_onto(x_scale, x_term, contracted, out)
  if math.prod(g.shape[out.index(c)] for c in tokens) > MAX_CONTRACTION:
    dw = jnp.einsum(f"{x_term},{out}->{w_term}", dequantize_int8(x_codes, 1.0, w.dtype),
                    g_x.astype(w.dtype), preferred_element_type=jnp.float32)
  else:
    g_x, g_x_scale = quantize_int8(g_x, [out.index(c) for c in tokens])  # per channel
    acc = jnp.einsum(f"{x_term},{out}->{w_term}", x_codes, g_x, preferred_element_type=jnp.int32)
    dw = acc.astype(jnp.float32) * _scale_onto(g_x_scale, out, tokens, w_term)
  return dx.astype(x.dtype), dw.astype(w.dtype)


def einsum(spec: str, operands, w_index: int, kwargs: dict,
           int8_backward: bool = False) -> jax.Array | None:
  """The model's `jnp.einsum(spec, *operands, **kwargs)` with the weight at `w_index` through
  the int8 path (its result dtype kept: `preferred_element_type` or the operands'); None where
  the spec has '...' on both operands or kwargs the int8 path does not take (the caller falls
  back to the fake-quant matmul)."""
  explicit = explicit_terms(spec, [o.ndim for o in operands])
  if explicit is None or set(kwargs) - {"precision", "preferred_element_type"}:
    return None
  terms, out = explicit
  x_index = 1 - w_index
  out_dtype = kwargs.get("preferred_element_type") or jnp.result_type(*operands)
  return int8_trained_einsum(tuple(terms), out, x_index, jnp.dtype(out_dtype).name,
                             bool(int8_backward), operands[x_index], operands[w_index])
