"""The grouped matmul behind `model.moe_impl`, and a record of how each traced MoE call ran.

- 'ragged' uses `jax.lax.ragged_dot`: XLA's own grouped matmul on every platform (the TPU
  compiler lowers it to its Mosaic ragged-dot kernel; XLA:CPU and XLA:GPU loop over groups).
- 'tokamax' uses `tokamax.ragged_dot` (openxla's Pallas kernel library, the optional `tokamax`
  extra) with the kernels of the platform the step compiles for (`TOKAMAX_IMPLEMENTATIONS`):
  its Mosaic kernel on a TPU v5 or newer, its Triton kernel on an NVIDIA GPU, its XLA path
  (`ragged_dot` with float32 accumulation) elsewhere and wherever a kernel declines the call.
  tokamax 0.0.12 reads the live device's kind to build its TPU kernel, so a deviceless TPU
  compile (`plan --target tpu:...` from a CPU host) takes the XLA path, which the TPU compiler
  lowers to its own Mosaic ragged-dot, as for 'ragged' (measured: "Unsupported TPU device kind:
  cpu"). Its Triton kernel does compile for a GPU target from a CPU host.
- 'dense' (the reference) uses no grouped matmul.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from distillax.models import layer_scope, remat, tokamax_support
from distillax.models.attention.impl import compile_platform

RaggedDot = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

TOKAMAX_MISSING = ("model.moe_impl='tokamax' needs the tokamax package (pip install "
                   "'distillax[tokamax]'); or set --config.model.moe_impl=ragged")


def tokamax_installed() -> bool:
  return tokamax_support.tokamax_installed()


# tokamax's implementations to try (the first that accepts the call wins), by the platform the
# step compiles for; elsewhere its XLA path. GPUs get its Triton kernel, which a deviceless H100
# compile lowers (tests/plan/test_target.py); its Mosaic GPU kernel (sm90+) declined the tiny
# MoE's calls there even in bfloat16, so it stays out until a GPU shows where it serves.
TOKAMAX_IMPLEMENTATIONS = {"tpu": ("mosaic_tpu", "xla"), "gpu": ("triton", "xla")}


def tokamax_ragged_dot(lhs_NxD, rhs_ExDxF, group_sizes_E):
  """tokamax's ragged_dot with the kernels of the platform the step compiles for (module
  docstring); its XLA path elsewhere."""
  tokamax = tokamax_support.import_tokamax(TOKAMAX_MISSING)
  platform = compile_platform()
  implementation = TOKAMAX_IMPLEMENTATIONS.get(platform, ("xla",))
  if platform != jax.default_backend():  # "cpu", "gpu" or "tpu"
    # Compiling for devices this host lacks (plan --target): tokamax's GPU kernels must not ask
    # the host's devices whether they can run them. Set for the process, not for this call:
    # the backward pass is traced after it returns. Other platforms' lists ignore the flag.
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.FLAGS.tokamax_cross_compile = True
  return tokamax.ragged_dot(lhs_NxD, rhs_ExDxF, group_sizes_E, implementation=implementation)


def describe(impl: str) -> str:
  """What `impl` runs for the step being traced, as plan reports it."""
  if impl == "tokamax":
    platform = compile_platform()
    tried = ", ".join(TOKAMAX_IMPLEMENTATIONS.get(platform, ("xla",)))
    return f"tokamax (on {platform}: the first of {tried} that takes the call)"
  return {"ragged": "ragged (jax.lax.ragged_dot)"}.get(impl, impl)


def ragged_dot_for(impl: str) -> RaggedDot | None:
  """None: `grouped_ffn`'s default, jax.lax.ragged_dot."""
  return tokamax_ragged_dot if impl == "tokamax" else None


def grouped_ffn(xs_NxD, group_sizes_E, gate_ExDxF, up_ExDxF, down_ExFxD, act,
                ragged_dot: RaggedDot | None = None, biases=None, up_act=None,
                sorted_experts_N=None, every_row_grouped: bool = False):
  """The gated MLP of each expert over its contiguous group of rows (rows past the groups'
  total come out zero): act(gate) * up, or act(gate) * up_act(up) (gpt-oss). `biases`: None or
  (gate_ExF, up_ExF, down_ExD), added to each row by its expert `sorted_experts_N` (rows past
  the groups take the last expert's: their output is never used). `ragged_dot` None: looked up
  as `jax.lax.ragged_dot` when called, so QAT's interception of it (quant/intercept.py) sees
  these matmuls too. every_row_grouped: the caller knows the groups cover every row (a dropless
  dispatch), so no row needs masking."""
  ragged_dot = ragged_dot or jax.lax.ragged_dot
  # A grouped matmul leaves the rows past the groups' total undefined on a TPU (zeros on the
  # CPU): measured on a v5e, garbage (NaN in bf16) in them, and in the input gradient's (the
  # transpose is another grouped matmul over the same groups), reached the dropped tokens'
  # gradients. Zeroed here on the way in (which zeroes their gradient on the way back) and on
  # the way out.
  if every_row_grouped:
    grouped = lambda lhs, rhs: ragged_dot(lhs, rhs, group_sizes_E)
  else:
    in_groups_Nx1 = (jnp.arange(xs_NxD.shape[0]) < jnp.sum(group_sizes_E))[:, None]
    grouped = lambda lhs, rhs: jnp.where(in_groups_Nx1, ragged_dot(
        jnp.where(in_groups_Nx1, lhs, 0), rhs, group_sizes_E), 0)
  xs_NxD = remat.name_moe_rows(xs_NxD)
  gate_NxF, up_NxF = remat.name_mlp_gate_up(grouped(xs_NxD, gate_ExDxF),
                                            grouped(xs_NxD, up_ExDxF))
  bias = lambda b_ExX: jnp.take(b_ExX, sorted_experts_N, axis=0, mode="clip")
  if biases is not None:
    gate_NxF, up_NxF = gate_NxF + bias(biases[0]), up_NxF + bias(biases[1])
  if up_act is not None:
    up_NxF = up_act(up_NxF)
  out_NxD = grouped(act(gate_NxF) * up_NxF, down_ExFxD)
  return out_NxD if biases is None else out_NxD + bias(biases[2])


# ---- what ran: one entry per traced MoE call (a scanned layer stack is traced once) ----------

_COUNTER = layer_scope.ChoiceCounter("distillax_moe_choices")


def record(choice: str) -> None:
  _COUNTER.add(choice)
  layer_scope.record("experts", choice)


def recorded_choices():
  """Counts of how the MoE calls traced inside ran ('ragged, experts over data (all_to_all)',
  ...): what `plan` reports beside the attention choices."""
  return _COUNTER.counted()
