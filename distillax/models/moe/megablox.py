"""`model.moe_impl='megablox'`: the experts' grouped matmuls through JAX's own Pallas TPU kernel
(jax.experimental.pallas.ops.tpu.megablox, MaxText's `gmm`), with tiles chosen for the shapes.

Why a third kernel beside XLA's ragged_dot and tokamax's: the tiles. The kernel walks the sorted
rows in (tm, tk, tn) tiles, a tile of rows crossing a group boundary computed once per group it
touches (masked), and its backward is the same kernel for the input gradient and a transposed
one (tgmm) for the weights'. `TILING` is what benchmarks/grouped_matmul.py measured fastest on a
v5e at the MoE rows' expert shapes (benchmarks/results/tpu/); 0 means the whole dimension, so the
weights' tile is read once per row tile.

Off a TPU (and for a step compiled for another platform) the call is jax.lax.ragged_dot, the
same sums; `INTERPRET_OFF_TPU` (the tests) runs the Pallas kernel in its interpreter instead, so
the CPU suite checks this module's tiling and masking against the dense experts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from distillax.models.attention.impl import compile_platform

TILING = (512, 0, 0)  # (rows, contraction, outputs) per tile; 0: the whole dimension
MIN_ROW_TILE = 8  # fewer rows than this per tile (or none that divide the rows): ragged_dot
INTERPRET_OFF_TPU = False


def row_tile(rows: int, want: int) -> int | None:
  """The largest power-of-two fraction of `want` that divides `rows` (the kernel needs whole
  row tiles), at least MIN_ROW_TILE; None when there is none."""
  tile = min(want, rows)
  tile = 1 << int(math.log2(tile)) if tile > 0 else 0
  while tile >= MIN_ROW_TILE and rows % tile:
    tile //= 2
  return tile if tile >= MIN_ROW_TILE else None


def megablox_ragged_dot(lhs_NxK, rhs_ExKxM, group_sizes_E):
  """lhs rows grouped by `group_sizes_E` times each group's weight, the output in lhs' dtype
  (fp32 accumulation), as jax.lax.ragged_dot computes it; rows past the groups' total are left
  undefined (models/moe/kernels.grouped_ffn masks them)."""
  on_tpu = compile_platform() == "tpu"
  tm = row_tile(lhs_NxK.shape[0], TILING[0])
  if tm is None or not (on_tpu or INTERPRET_OFF_TPU):
    return jax.lax.ragged_dot(lhs_NxK, rhs_ExKxM, group_sizes_E)
  from jax.experimental.pallas.ops.tpu.megablox import ops  # noqa: PLC0415 (TPU only)
  K, M = rhs_ExKxM.shape[1], rhs_ExKxM.shape[2]
  tiling = (tm, min(TILING[1] or K, K), min(TILING[2] or M, M))
  return ops.gmm(lhs_NxK, rhs_ExKxM, group_sizes_E.astype(jnp.int32), lhs_NxK.dtype, tiling,
                 None, None, False, not on_tpu)
