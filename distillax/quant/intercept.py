"""How activation quantization and adapters reach the model's matmuls without model changes.

Our layers call `jnp.einsum(spec, x, self.w[...].astype(dt))` on `nnx.Param` values. qwix's
interception (`qwix.quantize_model` with a `QuantizationProvider`) swaps `jnp.einsum` and
`lax.dot_general` while the model's `__call__` runs (a per-instance subclass; state untouched).
Verified on our Transformer, unrolled and scanned, eager and under `jit`, with qwix's own
`QtProvider`: it recognises q/k/v/o, gate/up/down and lm_head as weights and fake-quantizes them.

We do not use `QtProvider`'s matmul itself: it also quantizes matmuls between two activations
(attention scores) and computes the quantized dot in an order a dequantized model cannot
reproduce, so PTQ and exported models would only match it up to rounding flips. Instead weights
are fake-quantized where they are read (`fakequant.QuantSiteParam`), and this interceptor only
hands each einsum / dot_general to the weight object that fed it, which quantizes the activation
input (QAT, PTQ) or adds its LoRA path (`lora.LoRAWeight`). A weight notes itself when read
(`note_read`); model code reads a weight before the matmul it feeds, so the oldest pending
read whose value (or, after a cast, whose shape) is an operand of an intercepted matmul is the
weight's. Oldest, because a mixture of experts reads gate, up and down (two of one shape) and
then runs their grouped matmuls (`jax.lax.ragged_dot`, or moe_impl='tokamax''s
`moe_kernels.tokamax_ragged_dot`, both intercepted) in that order.
Under expert parallelism (fsdp_ep, ep_tp: models/moe/parallel.py's shard_map exchange) the
grouped matmuls see each device's experts, a shard of the weight read along its expert axis:
QAT rounds their input rows there too (act_qtype); LoRA's adapters are not sharded with them, so
there the merged weight is used (the same numbers, no adapter dropout).

qwix internals used (pinned qwix 0.1.8): `flax_util.get_current_module_path` and
`model._apply_interceptors`.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from qwix._src import model as qwix_model
from qwix._src.utils import flax_util

from distillax.models import layer_scope
from distillax.models.moe import kernels as moe_kernels


QWIX_ATTRS = ("qwix_path", "disable_quant_stats_update", "qwix_rngs")
# qwix 0.1.8 on flax 0.12.8 emits DeprecationWarnings at every traced call; they are noise here.
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"qwix\..*")


# ---- weight reads ------------------------------------------------------------------------------

@dataclasses.dataclass
class WeightRead:
  owner: Any  # the object whose __getitem__ produced `value`
  value: Any  # the array handed to the model


_MAX_PENDING = 8  # reads no matmul took (a norm's scale, an embedding lookup) age out


class _Reads(threading.local):
  def __init__(self):
    self.pending: list[WeightRead] = []  # oldest first


_READS = _Reads()


def note_read(owner: Any, value: Any) -> None:
  """Called by weight objects when the model reads them."""
  _READS.pending = (_READS.pending + [WeightRead(owner, value)])[-_MAX_PENDING:]


def clear_reads() -> None:
  _READS.pending = []


def _shape(x) -> tuple:
  return tuple(getattr(x, "shape", ()))


def _local_groups(operand, read: WeightRead) -> bool:
  """Whether `operand` is a shard of the read along its leading (group) axis: one device's
  experts inside the expert-parallel exchange."""
  op, full = _shape(operand), _shape(read.value)
  return (len(op) == len(full) > 1 and op[1:] == full[1:] and 0 < op[0] < full[0]
          and full[0] % op[0] == 0)


def take_read(operands: Sequence[Any], sides: Sequence[int] = (1, 0),
              local_groups: bool = False) -> tuple[WeightRead, int] | None:
  """The pending read that feeds one of `operands` (tried in `sides` order) and that operand's
  index; it is consumed with every read older than it (reads feed matmuls in order).

  The operand is the read value itself or a cast of it (`.astype(compute dtype)`), so identity
  is tried first (any pending read) and the shape second (the oldest read of that shape);
  with `local_groups` (grouped matmuls) last a shard of a read along its group axis.
  """
  pending = _READS.pending
  if len(operands) != 2:
    return None
  found = next(((j, i) for j, read in enumerate(pending) for i in sides
                if operands[i] is read.value), None)
  if found is None:
    found = next(((j, i) for j, read in enumerate(pending) for i in sides
                  if _shape(operands[i]) == _shape(read.value)), None)
  if found is None and local_groups:
    found = next(((j, i) for j, read in enumerate(pending) for i in sides
                  if _local_groups(operands[i], read)), None)
  if found is None:
    return None
  j, i = found
  _READS.pending = pending[j + 1:]
  return pending[j], i


def take_lookup_read(table: Any, method: str) -> WeightRead | None:
  """The newest pending read when `table` (a lookup's operand: `jnp.take(table, ids)`) is it,
  by identity or else by shape and dtype (a cast to the same dtype), and its owner has
  `method`; consumed alone (a lookup is no matmul: older reads still feed theirs). Model code
  looks up right after reading the table."""
  if not _READS.pending:
    return None
  read = _READS.pending[-1]
  same = table is read.value or (_shape(table) == _shape(read.value) and
                                 getattr(table, "dtype", None) == getattr(read.value, "dtype", 0))
  if not same or not hasattr(read.owner, method):
    return None
  _READS.pending = _READS.pending[:-1]
  return read


def current_module_path() -> str:
  return "/".join(map(str, flax_util.get_current_module_path()))


# ---- the interceptor ---------------------------------------------------------------------------

# moe_impl='tokamax' groups its matmuls with this function (imported by name into models/moe/layer.py;
# qwix patches the function's code, so every reference is intercepted).
_TOKAMAX_RAGGED_DOT = "distillax.models.moe.kernels.tokamax_ragged_dot"

class Interceptor(qwix.QuantizationProvider):
  """Hands each intercepted einsum / dot_general fed by a noting weight to that weight."""

  def __init__(self):
    super().__init__([])

  def get_intercept_map(self):
    return super().get_intercept_map() | {"jax.numpy.einsum": self.einsum,
                                          "jax.lax.dot_general": self.dot_general,
                                          "jax.lax.ragged_dot": self.ragged_dot,
                                          _TOKAMAX_RAGGED_DOT: self.tokamax_ragged_dot}

  def process_model_inputs(self, model, model_args, model_kwargs):
    clear_reads()
    return super().process_model_inputs(model, model_args, model_kwargs)

  def einsum(self, einsum_str, *operands, **kwargs):
    taken = take_read(operands)
    if taken is not None and hasattr(taken[0].owner, "intercepted_einsum"):
      read, index = taken
      return read.owner.intercepted_einsum(einsum_str, operands, index, kwargs)
    return jnp.einsum(einsum_str, *operands, **kwargs)

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, *, out_sharding=None):
    taken = take_read((lhs, rhs))
    kwargs = dict(precision=precision, preferred_element_type=preferred_element_type)
    if out_sharding is not None:
      kwargs["out_sharding"] = out_sharding
    if taken is not None and hasattr(taken[0].owner, "intercepted_dot_general"):
      read, index = taken
      return read.owner.intercepted_dot_general(lhs, rhs, dimension_numbers, index, kwargs)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)

  def ragged_dot(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                 **kwargs):
    kwargs = dict(precision=precision, preferred_element_type=preferred_element_type, **kwargs)
    return self.grouped(jax.lax.ragged_dot, lhs, rhs, group_sizes, kwargs)

  def tokamax_ragged_dot(self, lhs, rhs, group_sizes):
    return self.grouped(moe_kernels.tokamax_ragged_dot, lhs, rhs, group_sizes, {})

  def grouped(self, dot, lhs, rhs, group_sizes, kwargs):
    """A grouped matmul `dot` (lhs (M, K) rows, rhs (G, K, N): one matrix per group of rows;
    moe_impl 'ragged' or 'tokamax'): the weight is always rhs, and its owner computes with
    `dot` too. Inside the expert-parallel exchange rhs holds this device's experts only."""
    taken = take_read((lhs, rhs), sides=(1,), local_groups=True)
    if taken is not None and hasattr(taken[0].owner, "intercepted_ragged_dot"):
      return taken[0].owner.intercepted_ragged_dot(lhs, rhs, group_sizes, kwargs, dot)
    return dot(lhs, rhs, group_sizes, **kwargs)


# ---- installing and removing interception ------------------------------------------------------

def unintercepted_type_of(cls: type) -> type:
  return getattr(cls, "_unquantized_type", cls)


def unintercepted_type(model: nnx.Module) -> type:
  return unintercepted_type_of(type(model))


def install(model: nnx.Module, provider: qwix.QuantizationProvider,
            sample_tokens: jax.Array | None = None) -> nnx.Module:
  """A copy of `model` whose forward runs under `provider` (`__call__` and, where the model has
  it, `logits_from_hidden`, which chunked losses call outside `__call__`).

  The copy shares the arrays (shardings kept) and has the same state tree; only its GraphDef
  differs. Nothing is computed: qwix's initialising call is skipped (no static scales).
  """
  tokens = jnp.zeros((1, 1), jnp.int32) if sample_tokens is None else sample_tokens
  with layer_scope.unrecorded():  # qwix's probe trace: no part of any step
    quantized = qwix.quantize_model(model, provider, tokens, skip_nnx_init=True)
  cls, base = type(quantized), unintercepted_type(quantized)
  if hasattr(base, "logits_from_hidden"):
    cls.logits_from_hidden = qwix_model._apply_interceptors(  # pylint: disable=protected-access
        base.logits_from_hidden, provider, output_transform=lambda out: out)
  return quantized


def strip(model: nnx.Module) -> nnx.Module:
  """A copy of `model` with no interception: its own class, no qwix attributes."""
  plain = nnx.clone(model)
  plain.__class__ = unintercepted_type(plain)
  for _, module in nnx.iter_modules(plain):
    for name in QWIX_ATTRS:
      if name in vars(module):
        delattr(module, name)
  return plain
