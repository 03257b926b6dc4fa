"""How the next-token cross-entropy runs (`train.loss_impl`), and a record of what each traced
token loss ran, for `plan`.

- 'chunked' (the default): the vocabulary-chunk engine (vocab_chunks.py), which every
  distillation term uses too: the logits of a chunk of positions at a time, any output layer
  (soft-cap, fake-quantized or adapted head), plus the argmax accuracy.
- 'tokamax': `tokamax.linear_softmax_cross_entropy_loss` (openxla's Pallas kernel library, the
  optional `tokamax` extra), which projects the final hidden states and takes the loss in one
  op, given the output layer as a plain (D, V) matrix. tokamax 0.0.12 has a kernel for TPUs
  only (Mosaic, v5 and newer): on a TPU the loss runs it, each device on its own rows (a Mosaic
  kernel is not partitioned by the compiler); elsewhere its XLA path, which forms the whole
  (rows, V) logits. It gives the loss only: no accuracy in the training metrics.

The loss mask is 0/1 (every batch distillax builds): tokamax's loss has no per-token weight, so
masked positions enter as zero hidden states, whose loss is exactly log(V) each, subtracted
after; their gradient is zero.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from distillax import partitioning as pt
from distillax.errors import ConfigError
from distillax.models import layer_scope, tokamax_support
from distillax.models.attention.impl import compile_platform

LOSS_IMPLS = ("auto", "chunked", "sliced", "tokamax")
TOKAMAX_MISSING = ("train.loss_impl='tokamax' needs the tokamax package (pip install "
                   "'distillax[tokamax]'); or set --config.train.loss_impl=chunked")
# tokamax's Mosaic TPU kernel works on blocks of at least 1024 rows: each device's rows are
# padded with zero rows to a multiple of it.
TPU_ROW_BLOCK = 1024

_COUNTER = layer_scope.ChoiceCounter("distillax_loss_choices")


def record(choice: str) -> None:
  _COUNTER.add(choice)


def recorded_choices():
  """Counts of how the token losses traced inside ran: what `plan` reports beside the attention
  and MoE choices."""
  return _COUNTER.counted()


def check_loss_impl(value, job: str, supported: bool, why_not: str | None = None,
                    sliced: bool = False, sliced_why_not: str | None = None) -> None:
  """`train.loss_impl`: one of LOSS_IMPLS. 'tokamax' only for a job whose objective is the
  next-token CE (`supported`), over an output layer tokamax can take (`why_not` says why not),
  with tokamax installed. 'sliced' (framework/vocab_slices.py) for a job whose train losses it
  computes (`sliced`: next-token CE, forward-KL LogitKD) over an output layer it can read
  (`sliced_why_not`). 'auto': 'sliced' where it may run, else 'chunked' (resolve_loss_impl)."""
  if value not in LOSS_IMPLS:
    raise ConfigError(f"train.loss_impl={value!r}; choose one of {', '.join(LOSS_IMPLS)}")
  if value == "auto":
    return
  if value == "sliced":
    if not sliced:
      raise ConfigError(f"train.loss_impl='sliced': the {job} job's train losses are not ones "
                        f"vocabulary slices compute (next-token CE, and LogitKD's forward KL "
                        f"with one teacher); set --config.train.loss_impl=chunked")
    if sliced_why_not:
      raise ConfigError(f"train.loss_impl='sliced' cannot take this output layer: "
                        f"{sliced_why_not}; "
                        f"set --config.train.loss_impl=chunked")
    return
  if value != "tokamax":
    return
  if not supported:
    raise ConfigError(f"train.loss_impl='tokamax': the {job} job's token losses run the chunked "
                      f"engine (tokamax's loss is next-token cross-entropy only; lm and "
                      f"sequence_kd use it); set --config.train.loss_impl=chunked")
  if why_not:
    raise ConfigError(f"train.loss_impl='tokamax' cannot take this output layer: {why_not}; set "
                      f"--config.train.loss_impl=chunked")
  if not tokamax_support.tokamax_installed():
    raise ConfigError(TOKAMAX_MISSING)


def resolve_loss_impl(value, sliced: bool, sliced_why_not: str | None) -> str:
  """What train.loss_impl runs: 'auto' is 'sliced' where the job's losses and output layer allow
  it (on the TPU v5e it was 1.20x the chunked engine's KD step, 1.22x its train step:
  benchmarks/results/tpu/levers_call2.jsonl), else 'chunked'."""
  if value != "auto":
    return value
  return "sliced" if sliced and not sliced_why_not else "chunked"


def _local_loss(x_bxlxD, labels_bxl, keep_bxl, weight_DxV, implementation: str,
                row_block: int, device):
  """This device's loss sum over its rows: masked rows are zero (log V each, subtracted),
  rows padded with zeros to a multiple of `row_block`. device: see tokamax_support.traced_on."""
  tokamax = tokamax_support.import_tokamax(TOKAMAX_MISSING)
  D, V = weight_DxV.shape
  x_NxD = x_bxlxD.reshape(-1, D)
  labels_N = labels_bxl.reshape(-1)
  pad = -x_NxD.shape[0] % row_block
  x_NxD = jnp.pad(x_NxD, ((0, pad), (0, 0)))
  labels_N = jnp.pad(labels_N, (0, pad))
  loss_fn = lambda x, w: tokamax.linear_softmax_cross_entropy_loss(
      x, labels_N, w, implementation=implementation)
  loss = tokamax_support.traced_on(device, loss_fn)(x_NxD, weight_DxV)
  zero_rows = x_NxD.shape[0] - jnp.sum(keep_bxl.astype(jnp.float32))
  return loss - zero_rows * jnp.float32(math.log(V))


def _row_axes(batch: int, length: int, width: int):
  """(mesh, mesh axes of the batch, of the length) under the active rules."""
  active = pt.active_rules()
  spec = active.rules.resolve(("batch", "length", "embed"), (batch, length, width), active.mesh,
                              "tokamax cross-entropy rows")
  return active.mesh, spec[0], spec[1]


def cross_entropy_sum(hidden_BxLxD: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array,
                      weight_DxV: jax.Array, *, implementation: str | None = None,
                      per_device: bool | None = None,
                      row_block: int = TPU_ROW_BLOCK) -> jax.Array:
  """Sum of the next-token NLL over the positions whose mask is > 0, through tokamax.

  weight_DxV: the output layer, in the compute dtype. implementation: tokamax's ('mosaic_tpu'
  or 'xla'); None: 'mosaic_tpu' when the step compiles for a TPU, else 'xla'. per_device: each
  device's rows apart (a shard_map), padded to a multiple of `row_block` rows, as the Mosaic
  kernel needs; None: with the Mosaic kernel. (Each zero row adds log(V) to tokamax's fp32 sum
  before it is taken off: a device whose rows are mostly padding loses digits to it.)"""
  if implementation is None:
    implementation = "mosaic_tpu" if compile_platform() == "tpu" else "xla"
  per_device = implementation == "mosaic_tpu" if per_device is None else per_device
  keep_BxL = mask_BxL > 0
  x_BxLxD = jnp.where(keep_BxL[..., None], hidden_BxLxD, 0).astype(weight_DxV.dtype)
  labels_BxL = jnp.where(keep_BxL, targets_BxL, 0).astype(jnp.int32)
  if not per_device or pt.active_rules() is None:
    record(f"tokamax linear_softmax_cross_entropy_loss ({implementation}, whole logits)")
    row_block = row_block if implementation == "mosaic_tpu" else 1
    return _local_loss(x_BxLxD, labels_BxL, keep_BxL, weight_DxV, implementation, row_block,
                       None)
  record(f"tokamax linear_softmax_cross_entropy_loss ({implementation}, each device's rows)")
  mesh, batch_axes, length_axes = _row_axes(*hidden_BxLxD.shape)
  device = tokamax_support.target_device() if implementation == "mosaic_tpu" else None
  rows = P(batch_axes, length_axes)
  row_axes = pt.axes_tuple(batch_axes) + pt.axes_tuple(length_axes)
  local = lambda x, y, k, w: _local_loss(x, y, k, w, implementation, row_block, device)[None]
  per_device_sums = jax.shard_map(
      local, mesh=mesh, in_specs=(P(batch_axes, length_axes, None), rows, rows, P()),
      out_specs=P(row_axes if row_axes else None), check_vma=False)(
          x_BxLxD, labels_BxL, keep_BxL, weight_DxV)
  return jnp.sum(per_device_sums)
