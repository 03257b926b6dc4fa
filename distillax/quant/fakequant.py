"""Fake quantization with a straight-through backward, in one code path for QAT, PTQ and export.

Weights: a matched weight's variable becomes a `QuantSiteParam` (an `nnx.Param`: same path,
value, `logical_axes` and sharding) whose read returns the weight rounded to its grid. The
rounding is qwix's (`qwix.quantize` / `qwix.dequantize`: absmax, one scale per output channel or
per tile of the last contracted axis, round to nearest) on the weight cast to the compute dtype,
so PTQ, the exported integers and the QAT forward agree bit for bit. llama.cpp's q8_0 / q4_0
weights (and q8_0 activations) round with `ggml.py` instead, exactly as ggml does.

Activations: the input of a quantized weight's matmul is rounded the same way (one scale per
token, or per tile of its last contracted axis) by the interceptor (`intercept.py`), which
learns which matmul a weight feeds because the weight notes its read.

Backward: straight through (identity) for both, so gradients reach the full-precision weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from qwix._src.core import numerics as qwix_numerics
from qwix._src.core import qarray as qwix_qarray

from distillax import partitioning as pt
from distillax.errors import UserError
from distillax.quant import ggml, int8_train, intercept


@dataclasses.dataclass(frozen=True)
class WeightQuant:
  """How one weight (and the input of its matmul) is quantized. Static: lives in the GraphDef.

  Axes are those of the weight as its matmul sees it (one layer under scan_layers); stored
  variables may carry extra leading (stacked) axes, which get their own scales.
  """

  qtype: str
  contract_axes: tuple[int, ...]  # in dot_general order; tiles go on the last one
  ndim: int
  tile_size: int | None = None
  compute_dtype: str = "float32"  # weights are rounded in the dtype the matmul uses
  act_qtype: str | None = None
  # int8 weights and activations multiplied as int8 codes (quant/int8_train.py): the weight is
  # read unrounded and rounded by its matmul (QuantConfig.int8_matmul).
  int8_matmul: bool = False
  int8_backward: bool = False  # ... and its backward's two matmuls too (QuantConfig.int8_backward)

  def axes(self, stored_ndim: int) -> tuple[tuple[int, ...], dict[int, int]]:
    """(channelwise axes, {tiled axis: tile}) for a stored array of rank `stored_ndim`."""
    lead = stored_ndim - self.ndim
    contract = [a + lead for a in self.contract_axes]
    tiled = {contract[-1]: self.tile_size} if self.tile_size else {}
    channelwise = tuple(i for i in range(stored_ndim) if i not in contract and i not in tiled)
    return channelwise, tiled


# ---- weights -----------------------------------------------------------------------------------

def quantize_weight(w: jax.Array, wq: WeightQuant) -> tuple[jax.Array, jax.Array]:
  """(qvalue, scale): qvalue int8 / int4 / uint4 (nf4 codes) / float8_e4m3fn; scale in the
  compute dtype with the weight's rank (1 on reduced axes, #tiles on tiled axes)."""
  if wq.qtype in ggml.WEIGHT_QTYPES:
    raise UserError(f"weight type {wq.qtype} is llama.cpp's block format: export it with "
                    f"`distillax export --format gguf`; integer codes for QLoRA bases and "
                    f"--format quantized take int8, int4, nf4 or float8_e4m3fn")
  channelwise, tiled = wq.axes(w.ndim)
  q = qwix.quantize(w.astype(wq.compute_dtype), wq.qtype, channelwise_axes=channelwise,
                    tiled_axes=tiled)
  return q.qvalue, q.scale


@functools.cache
def _nf4_table() -> tuple[float, ...]:
  """qwix's nf4 values as float32 numbers (read once, outside any trace)."""
  with jax.ensure_compile_time_eval():
    return tuple(np.asarray(qwix_numerics.get_nf4_buckets(), np.float32).tolist())


def nf4_values(codes: jax.Array) -> jax.Array:
  """qwix's nf4 table at `codes` (0..15), float32, by a tree of 15 selects on the code's bits.

  Why not the table lookup qwix does (`numerics.nf4_to_fp`, a gather over the raveled
  array): a gather does not fuse into the matmul that reads the weight, so a QLoRA base was
  dequantized into a full weight-sized array by a slow per-element gather in the forward, the
  backward and the remat's recompute. Selects between constants are elementwise: the compiler
  fuses them into the operand of the matmul. The values are the table's, bit for bit."""
  level = [jnp.float32(v) for v in _nf4_table()]
  codes = codes.astype(jnp.uint8)
  for bit in range(4):  # lowest bit first: pairs (2i, 2i + 1), then pairs of pairs, ...
    on = (codes & (1 << bit)) != 0
    level = [jnp.where(on, level[i + 1], level[i]) for i in range(0, len(level), 2)]
  return level[0]


def qwix_dequantize(qvalue: jax.Array, scale: jax.Array, qtype: str) -> jax.Array:
  return qwix.dequantize(qwix.QArray(qvalue, scale, None, qtype))


def nf4_dequantize_by_selects(qvalue: jax.Array, scale: jax.Array) -> jax.Array:
  """qwix's nf4 dequantization with the table read by `nf4_values`: the same arithmetic."""
  values = nf4_values(qvalue).astype(scale.dtype)
  return qwix_qarray.call_with_generic_broadcast(jnp.multiply, values, scale)


def _nf4_dequantize_on_cpu(qvalue: jax.Array, scale: jax.Array) -> jax.Array:
  """A CPU reads qwix's table by a gather at the cost of a load (the selects measured ~7%
  slower QLoRA steps in benchmarks/peft.py) and fuses nothing into its matmuls anyway."""
  return qwix_dequantize(qvalue, scale, "nf4")


def dequantize(qvalue: jax.Array, scale: jax.Array, qtype: str) -> jax.Array:
  """Values on the quantization grid, in the scale's dtype (qwix's arithmetic). nf4 codes are
  read by selects (`nf4_values`) wherever the program is lowered for an accelerator, by qwix's
  gather on a CPU: the same bits (`lax.platform_dependent` picks at lowering, so a deviceless
  compile for a TPU takes the selects)."""
  if qtype == "nf4":
    return jax.lax.platform_dependent(qvalue, scale, cpu=_nf4_dequantize_on_cpu,
                                      default=nf4_dequantize_by_selects)
  return qwix_dequantize(qvalue, scale, qtype)


def fake_quantize_weight(w: jax.Array, wq: WeightQuant) -> jax.Array:
  """The weight rounded to its grid, in its own dtype (exact: grid values fit the dtype).
  ggml's q8_0 / q4_0 round in float32 whatever the compute dtype, as llama.cpp does."""
  if wq.qtype in ggml.WEIGHT_QTYPES:
    lead = w.ndim - wq.ndim  # stacked layers: every layer gets its own blocks
    return ggml.fake_quantize(w, wq.qtype, [a + lead for a in wq.contract_axes])
  return dequantize(*quantize_weight(w, wq), wq.qtype).astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def ste_weight(w: jax.Array, wq: WeightQuant) -> jax.Array:
  return fake_quantize_weight(w, wq)


def _ste_weight_fwd(w, wq):
  return fake_quantize_weight(w, wq), None


def _ste_weight_bwd(wq, _, g):
  del wq
  return (g,)


ste_weight.defvjp(_ste_weight_fwd, _ste_weight_bwd)


# ---- activations -------------------------------------------------------------------------------

def fake_quantize(x: jax.Array, qtype: str, channelwise: Sequence[int],
                  tiled: tuple[tuple[int, int], ...]) -> jax.Array:
  if qtype in ggml.ACT_QTYPES:  # blocks of 32 along every axis not kept per token
    return ggml.fake_quantize_activation(
        x, qtype, [i for i in range(x.ndim) if i not in tuple(channelwise)])
  q = qwix.quantize(x, qtype, channelwise_axes=tuple(channelwise), tiled_axes=dict(tiled))
  return dequantize(q.qvalue, q.scale, qtype).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def ste_activation(x, qtype, channelwise, tiled):
  return fake_quantize(x, qtype, channelwise, tiled)


def _ste_act_fwd(x, qtype, channelwise, tiled):
  return fake_quantize(x, qtype, channelwise, tiled), None


def _ste_act_bwd(qtype, channelwise, tiled, _, g):
  del qtype, channelwise, tiled
  return (g,)


ste_activation.defvjp(_ste_act_fwd, _ste_act_bwd)


def einsum_parts(spec: str, ndims: Sequence[int]) -> tuple[list[list[str | None]], str]:
  """Per-operand letters (None for dims under '...') and the output letters."""
  spec = spec.replace(" ", "")
  if "->" in spec:
    ins, out = spec.split("->")
  else:  # implicit output: letters seen once, sorted (numpy's rule)
    ins = spec
    letters = ins.replace(",", "").replace(".", "")
    out = ("..." if "..." in ins else "") + "".join(sorted(c for c in set(letters)
                                                           if letters.count(c) == 1))
  parts = []
  for term, ndim in zip(ins.split(","), ndims):
    if "..." in term:
      head, tail = term.split("...")
      parts.append(list(head) + [None] * (ndim - len(head) - len(tail)) + list(tail))
    else:
      parts.append(list(term))
  return parts, out


def activation_axes(x_letters: Sequence[str | None], w_letters: Sequence[str | None], out: str,
                    tile_size: int | None) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
  """One scale per non-contracted index of the input (per token), tiles on its last
  contracted axis."""
  contract = [i for i, c in enumerate(x_letters)
              if c is not None and c in w_letters and c not in out]
  tiled = ((contract[-1], tile_size),) if tile_size and contract else ()
  skip = set(contract)
  return tuple(i for i in range(len(x_letters)) if i not in skip), tiled


def stored_placement(rounded: jax.Array, logical_axes: Sequence[str | None] | None) -> jax.Array:
  """The rounded weight constrained to the stored weight's placement (its logical axes under the
  active rules; under scan the leading 'layers' name is dropped).

  Why: rounding reshapes the weight into blocks along its contracted axes, and where a shard's
  contracted size is not a multiple of 32 (attention's output weight with head_dim 24, heads on
  `model`) GSPMD cannot keep the stored sharding through the reshape and gathers the rounded
  weight. The matmul is then contracted whole on every device, while PTQ (and every other
  read) contracts per shard and all-reduces: a different float summation order, which q8_0
  activation rounding in later layers turns into whole-step flips. Pinned, QAT and PTQ compile
  the same matmul.
  """
  if not logical_axes or len(logical_axes) < rounded.ndim:
    return rounded
  return pt.constrain(rounded, tuple(logical_axes)[len(logical_axes) - rounded.ndim:])


class QuantSiteParam(nnx.Param):
  """A weight feeding a quantized matmul. Metadata `quant` (a WeightQuant) says how.

  `round_on_read=True` (QAT): reads return the straight-through fake-quantized weight.
  False (PTQ / loaded models): the stored value is already on the grid and is read as is; the
  variable is only there to tell the interceptor which matmul quantizes its input.
  """

  def __getitem__(self, index) -> Any:
    value = super().__getitem__(index)
    meta = self.get_metadata()
    if meta.get("round_on_read", True) and not meta["quant"].int8_matmul:
      value = stored_placement(ste_weight(value, meta["quant"]), meta.get("logical_axes"))
    intercept.note_read(self, value)
    return value

  @property
  def quant(self) -> WeightQuant:
    return self.get_metadata()["quant"]

  def output_operands(self, h_xD: jax.Array, vocab_axis: int) -> list:
    """The output layer's one matmul as `intercepted_einsum` runs it (a loss over vocabulary
    slices reads these, models/transformer.py): the weight rounded as a read rounds it, and an
    int8_matmul weight rounded here (its int8 dot multiplies the same grid values); the input
    rounded per token, tiles along its last axis."""
    wq = self.quant
    w = nnx.Param.__getitem__(self, ...)
    if wq.int8_matmul:
      w = ste_weight(w, wq)
    elif self.get_metadata().get("round_on_read", True):
      w = stored_placement(ste_weight(w, wq), self.get_metadata().get("logical_axes"))
    if wq.act_qtype is not None:
      last = h_xD.ndim - 1
      tiled = ((last, wq.tile_size),) if wq.tile_size else ()
      h_xD = ste_activation(h_xD, wq.act_qtype, tuple(range(last)), tiled)
    return [(h_xD, w, vocab_axis)]

  def _rounded_operand(self, operands, index) -> list:
    """The operands with the weight rounded here: an int8_matmul weight is read unrounded,
    and a matmul the int8 path does not take multiplies it fake-quantized."""
    ops = list(operands)
    if self.quant.int8_matmul:
      ops[index] = ste_weight(ops[index], self.quant)
    return ops

  def intercepted_einsum(self, spec, operands, index, kwargs):
    wq = self.quant
    if wq.int8_matmul:
      y = int8_train.einsum(spec, operands, index, kwargs, int8_backward=wq.int8_backward)
      if y is not None:
        return y
      operands = self._rounded_operand(operands, index)
    if wq.act_qtype is None:
      return jnp.einsum(spec, *operands, **kwargs)
    parts, out = einsum_parts(spec, [o.ndim for o in operands])
    x = operands[1 - index]
    channelwise, tiled = activation_axes(parts[1 - index], parts[index], out, wq.tile_size)
    ops = list(operands)
    ops[1 - index] = ste_activation(x, wq.act_qtype, channelwise, tiled)
    return jnp.einsum(spec, *ops, **kwargs)

  def intercepted_dot_general(self, lhs, rhs, dimension_numbers, index, kwargs):
    wq = self.quant
    if wq.act_qtype is not None:
      x_side = 1 - index
      x = (lhs, rhs)[x_side]
      contract = list(dimension_numbers[0][x_side])
      if not contract:
        raise UserError(f"{wq} matmul contracts no input axis; cannot quantize its input")
      tiled = ((contract[-1], wq.tile_size),) if wq.tile_size else ()
      channelwise = tuple(i for i in range(x.ndim) if i not in contract)
      xq = ste_activation(x, wq.act_qtype, channelwise, tiled)
      lhs, rhs = (xq, rhs) if x_side == 0 else (lhs, xq)
    lhs, rhs = self._rounded_operand((lhs, rhs), index)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)

  def intercepted_ragged_dot(self, x_MxK, w_GxKxN, group_sizes_G, kwargs, dot):
    """An expert's grouped matmul `dot`: rows rounded per row (a token), tiles along K."""
    wq = self.quant
    if wq.act_qtype is not None:
      tiled = ((1, wq.tile_size),) if wq.tile_size else ()
      x_MxK = ste_activation(x_MxK, wq.act_qtype, (0,), tiled)
    _, w_GxKxN = self._rounded_operand((x_MxK, w_GxKxN), 1)
    return dot(x_MxK, w_GxKxN, group_sizes_G, **kwargs)
