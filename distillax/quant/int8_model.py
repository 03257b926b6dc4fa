"""A frozen model (a teacher) whose projection matmuls run in int8: `int8_model(model)`.

Every weight that feeds a matmul (attention q/k/v/o, the MLP's gate/up/down, an MoE's experts,
the output layer: `lm_head`, or the tied embedding used as the head; never an MoE router, whose
top-k picks experts) is replaced by an `Int8Weight`: int8 codes + float32 scales per output
channel (int8_dot.py's grid), stored *instead of* the weight, so the model's memory halves from
bf16. The conversion is one jit on the device, weights placed as they were. The model's code is
unchanged: its forward runs under the interceptor (intercept.py), which hands each matmul fed
by an Int8Weight to it; the weight quantizes the matmul's input per token and runs
int8_dot.py's int8 x int8 -> int32 product. Embedding lookups, norms and everything else stay
as they were: a tied embedding's lookup gathers its int8 rows and their scales (never the whole
dequantized table). A read outside a matmul (`w[...]`: a loss that takes the output layer's
weight, `output_operands`) gives the dequantized weight, the same values.

Frozen only: a gradient through an int8 matmul is refused (int8_dot.frozen_input), and a model
with LoRA adapters or fake quantization is refused (merge or strip it first).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.errors import ConfigError
from distillax.quant import int8_dot, intercept
from distillax.quant.fakequant import QuantSiteParam
from distillax.quant.graph import derived_sharding, get_path, set_path
from distillax.quant.sites import MatmulSite, find_matmul_sites, has_wrapped_weights
from distillax.quant.weights import QuantizedValue, QuantizedWeight, scale_axes_map


class Int8Weight(nnx.Module):
  """A frozen matmul weight as int8 codes and float32 scales (1 on its contracted axes)."""

  def __init__(self, codes: jax.Array, scale: jax.Array, *, logical_axes, dtype,
               contract_axes, ndim: int, name: str):
    self.codes = QuantizedValue(codes, logical_axes=tuple(logical_axes))
    scale_logical = tuple(None if a is None else logical_axes[a]
                          for a in scale_axes_map(scale.shape, codes.shape))
    self.scale = QuantizedValue(scale, logical_axes=scale_logical)
    self.param_dtype = jnp.dtype(dtype)  # of the weight it replaces: what `w[...]` gives
    self.logical_axes = tuple(logical_axes)
    self.contract_axes = tuple(contract_axes)  # of the weight as its matmul sees it
    self.call_ndim = int(ndim)
    self.site_name = name

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.codes.shape)

  def dequantized(self) -> jax.Array:
    return int8_dot.dequantize_int8(self.codes[...], self.scale[...], self.param_dtype)

  def __getitem__(self, index) -> jax.Array:
    # What model code reads: the dequantized weight (dead code where a matmul takes the codes
    # instead, which XLA removes), noted so the interceptor finds the matmul it feeds.
    value = self.dequantized()[index]
    intercept.note_read(self, value)
    return value

  def _whole(self, operand) -> bool:
    """Whether `operand` is this weight as one matmul sees it (not a shard of its experts)."""
    return tuple(operand.shape) == self.shape[-self.call_ndim:]

  def intercepted_einsum(self, spec, operands, index, kwargs):
    w = operands[index]
    spelled = int8_dot.explicit_terms(spec, [o.ndim for o in operands])
    if spelled is None or not self._whole(w) or not self._same_contraction(*spelled, index):
      return jnp.einsum(spec, *operands, **kwargs)
    terms, out = spelled
    dtype = kwargs.get("preferred_element_type") or jnp.result_type(*operands)
    return int8_dot.int8_einsum(terms, out, operands[1 - index], 1 - index, self.codes[...],
                                self.scale[...], dtype, kwargs)

  def _same_contraction(self, terms, out, index) -> bool:
    """Whether the einsum contracts the axes this weight was quantized along (its scales)."""
    w_term, x_term = terms[index], terms[1 - index]
    contracted = tuple(i for i, c in enumerate(w_term) if c in x_term and c not in out)
    return contracted == tuple(sorted(self.contract_axes))

  def intercepted_dot_general(self, lhs, rhs, dimension_numbers, index, kwargs):
    w = (lhs, rhs)[index]
    if not self._whole(w) or tuple(sorted(dimension_numbers[0][index])) != tuple(
        sorted(self.contract_axes)):
      return jax.lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)
    dtype = kwargs.get("preferred_element_type") or jnp.result_type(lhs, rhs)
    return int8_dot.int8_dot_general((lhs, rhs)[1 - index], 1 - index, self.codes[...],
                                     self.scale[...], dimension_numbers, dtype, kwargs)

  def intercepted_ragged_dot(self, x_MxK, w_GxKxN, group_sizes_G, kwargs, dot):
    """lax.ragged_dot in int8; a Pallas grouped kernel (moe_impl='tokamax') and this device's
    experts inside the expert-parallel exchange take the dequantized weight as read."""
    if getattr(dot, "__name__", "") != "ragged_dot" or not self._whole(w_GxKxN):
      return dot(x_MxK, w_GxKxN, group_sizes_G, **kwargs)
    dtype = kwargs.get("preferred_element_type") or jnp.result_type(x_MxK, w_GxKxN)
    return int8_dot.int8_ragged_dot(x_MxK, self.codes[...], self.scale[...], group_sizes_G,
                                    dtype, kwargs)

  def intercepted_take(self, table, indices, axis, kwargs):
    """An embedding lookup of this (tied) weight: its int8 rows times their scales."""
    if axis != 0 or self.contract_axes != (1,) or not self._whole(table):
      return jnp.take(table, indices, axis=axis, **kwargs)
    rows = jnp.take(self.codes[...], indices, axis=0, **kwargs)
    scales = jnp.take(self.scale[...], indices, axis=0, **kwargs)
    return (rows.astype(jnp.float32) * scales).astype(table.dtype)


class Int8Interceptor(intercept.Interceptor):
  """The weights' interceptor, plus embedding lookups (`jnp.take`) of an Int8Weight."""

  def get_intercept_map(self):
    return super().get_intercept_map() | {"jax.numpy.take": self.take}

  def take(self, table, indices, axis=None, **kwargs):
    read = intercept.take_lookup_read(table, "intercepted_take")
    if read is not None:
      return read.owner.intercepted_take(table, indices, axis, kwargs)
    return jnp.take(table, indices, axis=axis, **kwargs)


# ---- converting a model ------------------------------------------------------------------------

def _refuse_transformed(model: nnx.Module) -> None:
  if has_wrapped_weights(model):
    raise ConfigError("the model to run in int8 has LoRA adapters; merge them first "
                      "(distillax.quant.merge_lora), a frozen teacher has none")
  kinds = {type(v).__name__ for _, v in nnx.iter_graph(model)
           if isinstance(v, (QuantSiteParam, QuantizedWeight, Int8Weight))}
  if kinds:
    raise ConfigError(f"the model to run in int8 is already quantized ({', '.join(sorted(kinds))}"
                      f"); start from its full-precision weights (distillax.quant.full_precision"
                      f" for a QAT model)")


def _reduce_axes(site: MatmulSite) -> tuple[int, ...]:
  """The stored weight's contracted axes (stacked layers lead)."""
  return tuple(a + site.stacked for a in site.contract_axes)


def _check_contraction(site: MatmulSite) -> None:
  size = math.prod(site.shape[a] for a in site.contract_axes)
  if size > int8_dot.MAX_CONTRACTION:
    raise ConfigError(f"{site.name} contracts {size} inputs per output, more than an int32 sum "
                      f"of int8 products holds ({int8_dot.MAX_CONTRACTION}); run this teacher "
                      f"without teacher.int8")


def _quantize_all(values: dict[str, jax.Array], axes: tuple[tuple[str, tuple[int, ...]], ...]):
  return {name: int8_dot.quantize_int8(values[name], reduce) for name, reduce in axes}


def quantize_weights(values: dict[str, jax.Array], axes: dict[str, tuple[int, ...]]
                     ) -> dict[str, tuple[jax.Array, jax.Array]]:
  """{name: (codes, scales)} of every weight, in one jit on the device; codes are placed like
  their weight, scales like its dims they keep (replicated along the reduced ones)."""
  plan = tuple(sorted(axes.items()))
  shardings = {}
  for name, reduce in plan:
    w = values[name]
    scale_shape = tuple(1 if i in reduce else d for i, d in enumerate(w.shape))
    shardings[name] = (derived_sharding(w, range(w.ndim)),
                       derived_sharding(w, scale_axes_map(scale_shape, w.shape)))
  placed = all(s is not None for pair in shardings.values() for s in pair)
  fn = jax.jit(_quantize_all, static_argnums=1,
               out_shardings=shardings if placed and shardings else None)
  return fn(values, plan)


def int8_model(model: nnx.Module, sample_tokens: jax.Array | None = None) -> nnx.Module:
  """A copy of the frozen `model` whose matmul weights are Int8Weights (see the module
  docstring); the arrays it does not quantize are shared with `model`. Works on real or
  abstract (inside `nnx.eval_shape`) models."""
  _refuse_transformed(model)
  sites = [s for s in find_matmul_sites(model, sample_tokens) if not s.is_router]
  for site in sites:
    _check_contraction(site)
  converted = intercept.strip(model)
  variables = {s.name: get_path(converted, s.weight_path) for s in sites}
  quantized = quantize_weights({n: v.get_raw_value() for n, v in variables.items()},
                               {s.name: _reduce_axes(s) for s in sites})
  for site in sites:
    var = variables[site.name]
    value = var.get_raw_value()
    logical = tuple(var.get_metadata().get("logical_axes") or (None,) * value.ndim)
    codes, scale = quantized[site.name]
    set_path(converted, site.weight_path, Int8Weight(
        codes, scale, logical_axes=logical, dtype=value.dtype, contract_axes=site.contract_axes,
        ndim=len(site.shape), name=site.name))
  return intercept.install(converted, Int8Interceptor(), sample_tokens)


def abstract_int8_model(abstract: nnx.Module) -> nnx.Module:
  """`int8_model` of an abstract model (ShapeDtypeStructs: no memory, nothing computed)."""
  return nnx.eval_shape(lambda: int8_model(abstract))


def state_bytes(model: nnx.Module) -> int:
  """Bytes of every array the model holds (real or abstract)."""
  leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))
  return sum(int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)
