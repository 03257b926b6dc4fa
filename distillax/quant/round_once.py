"""QAT's weights rounded once per forward, before the layer loop, not once per read inside it.

A `QuantSiteParam` with `round_on_read` rounds its weight where the model reads it. Under
`scan_layers` that read is inside the scanned body and inside the layer's remat, so every
layer's weight rounding (q4_0: a block absmax with an argmax and a gather, an fp16 rounding in
integer arithmetic, a divide) runs in the layer loop, and again in the backward's recompute,
though the weights change only once per step. None of it depends on the batch.

`install` gives the model a `__call__` that first rounds every round-on-read weight of the
whole (stacked) state at once, straight through (`fakequant.ste_weight`, so the gradient that
reaches the fp32 master weight is the one the per-read rounding gives), cast to the compute
dtype the model casts it to anyway, and pinned to the stored weight's placement; the layers
then run on those values read as they are (`round_on_read=False`, as PTQ reads a rounded
weight). The activations' rounding (q8_0 and the rest) stays inside, where the interceptor
does it. The numbers are those of rounding on read: ggml's blocks and qwix's tiles are per
layer whatever the leading (stacked) axes, and the cast to the compute dtype is the one the
model's own `.astype` did. Reads outside `__call__` (a chunked loss's `logits_from_hidden`,
the sliced loss's `output_operands`) still round on read: they are outside the layer loop.

Cost: the rounded weights, in the compute dtype, stay alive through the step (the scan's
backward reads them): one compute-dtype copy of the quantized weights.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from distillax.quant import intercept
from distillax.quant.fakequant import QuantSiteParam, stored_placement, ste_weight

_ROUNDING_TYPES: dict[type, type] = {}  # model class -> its rounding-once subclass (one each)


def rounds_on_read(var: Any) -> bool:
  """A QAT weight rounded where it is read (not PTQ's, already rounded, nor an int8_matmul
  weight, which its int8 matmul rounds to codes)."""
  if not isinstance(var, QuantSiteParam):
    return False
  meta = var.get_metadata()
  return meta.get("round_on_read", True) and not meta["quant"].int8_matmul


def rounded_variable(var: QuantSiteParam) -> QuantSiteParam:
  """The variable with its whole stored value rounded (straight through), in the compute dtype,
  placed like the stored weight, and read as is from now on."""
  meta = var.get_metadata()
  wq = meta["quant"]
  value = ste_weight(var.get_raw_value(), wq).astype(wq.compute_dtype)
  value = stored_placement(value, meta.get("logical_axes"))
  return var.replace(value, round_on_read=False)


def rounded_state(state: nnx.State) -> nnx.State:
  """`state` with every round-on-read weight rounded once (`rounded_variable`)."""
  return jax.tree.map(lambda v: rounded_variable(v) if rounds_on_read(v) else v, state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def _rounding_type(cls: type) -> type:
  """A subclass of `cls` whose `__call__` runs `cls`'s on a copy with its weights rounded."""
  if getattr(cls, "_rounds_weights_once", False):
    return cls
  if cls not in _ROUNDING_TYPES:
    call = cls.__call__

    def __call__(self, *args, **kwargs):
      graphdef, state = nnx.split(self)
      return call(nnx.merge(graphdef, rounded_state(state)), *args, **kwargs)

    _ROUNDING_TYPES[cls] = type(cls.__name__, (cls,), {
        "__call__": __call__, "__module__": cls.__module__, "_rounds_weights_once": True,
        "_unquantized_type": intercept.unintercepted_type_of(cls)})
  return _ROUNDING_TYPES[cls]


def install(model: nnx.Module) -> nnx.Module:
  """`model` (in place) with a forward that rounds its weights once before the layer loop;
  `intercept.strip` gives the plain class back."""
  if not any(rounds_on_read(v) for _, v in nnx.iter_graph(model)):
    return model
  model.__class__ = _rounding_type(type(model))
  return model
