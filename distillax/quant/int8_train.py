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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from distillax.quant.int8_dot import dequantize_int8, explicit_terms, onto_output, quantize_int8


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def int8_trained_einsum(terms: tuple[str, str], out: str, x_index: int, out_dtype: str,
                        x: jax.Array, w: jax.Array) -> jax.Array:
  """`einsum(terms -> out)` of x (operand `x_index`) and the weight w, both rounded to int8
  (x per token, w per output channel), multiplied in int8, given in `out_dtype`;
  straight-through backward."""
  return _forward(terms, out, x_index, out_dtype, x, w)


def _fwd(terms, out, x_index, out_dtype, x, w):
  return _forward(terms, out, x_index, out_dtype, x, w), (x, w)


def _bwd(terms, out, x_index, out_dtype, res, g):
  del out_dtype
  x, w = res
  x_term, w_term = terms[x_index], terms[1 - x_index]
  x_codes, x_scale, w_codes, w_scale = _grids(x_term, w_term, out, x, w)
  xq, wq = dequantize_int8(x_codes, x_scale, x.dtype), dequantize_int8(w_codes, w_scale, w.dtype)
  spec = f"{terms[0]},{terms[1]}->{out}"
  ordered = lambda a, b: (a, b) if x_index == 0 else (b, a)
  _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, *ordered(a, b)), xq, wq)
  g_x, g_w = vjp(g.astype(jnp.result_type(xq.dtype, wq.dtype)))
  return g_x.astype(x.dtype), g_w.astype(w.dtype)


int8_trained_einsum.defvjp(_fwd, _bwd)


def einsum(spec: str, operands, w_index: int, kwargs: dict) -> jax.Array | None:
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
                             operands[x_index], operands[w_index])
