"""The forward statistics of next-token cross-entropy over the whole vocabulary as one Pallas
kernel on a TPU: per position, the logits' maximum, the sum of exp(logit - maximum), the target's
logit and (for accuracy) the first argmax, without the logits ever leaving the chip's VMEM.

Why. The sliced engine's forward pass (vocab_slices._stats) writes each slice's fp32 logits to
HBM and reads them back twice, once for the maximum (with its index) and once for the sum of
exponentials and the target's logit. In chip call 31's profile of the 0.50B MoE student's train
step (8 x 2048, vocabulary 151,936, width 1024) the matmul took 27.4 ms and the two reductions
13.6 ms each: the reductions are bound by HBM, the matmul by the MXU. Here each tile of logits
is reduced where the matmul leaves it (online, as flash attention keeps its softmax), so the
forward pass costs about the matmul alone. The backward pass is unchanged: it recomputes each
slice's logits from the log-sum-exp this gives.

The grid runs over row tiles (parallel) and, innermost, vocabulary tiles (sequential): the
statistics of a row tile stay in its output blocks across the vocabulary, lane-replicated
(TILE_ROWS, 128) as the flash attention kernels keep theirs, and are read back as column 0.
The weight is read once per row tile in its stored dtype (fp32 master weights included: casting
the whole table first would hold a second copy) and cast per tile, so TILE_ROWS trades VMEM for
fewer passes over it.

It takes the plain head only: one matmul (no LoRA `more`), no soft-cap, a row count that the
row tile divides, and one device (a kernel the partitioner cannot split; on a larger mesh the
XLA path runs). `KERNEL` decides where: 'auto' on a TPU, 'xla' never, 'interpret' everywhere in
Pallas' interpreter (the tests, on a CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from distillax import partitioning as pt
from distillax.models.attention.impl import compile_platform

LANES = 128
TILE_ROWS = 1024  # positions per row tile (the weight is read once per row tile)
TILE_COLUMNS = 1024  # vocabulary columns per tile (chip call 48: 545 ms against 550 at 512)
VMEM_LIMIT_BYTES = 64 * 2**20
KERNEL = "auto"  # 'auto' (a TPU), 'xla' (never), 'interpret' (anywhere, interpreted)
_NO_COLUMN = 2**31 - 1


def tile_rows_for(rows: int) -> int | None:
  """The largest row tile of at most TILE_ROWS (a multiple of 128) that divides `rows`."""
  tile = TILE_ROWS
  while tile >= LANES:
    if rows % tile == 0:
      return tile
    tile //= 2
  return None


def applies(n_rows: int, n_parts: int, softcap) -> bool:
  """Whether the kernel computes these statistics (read when the step is traced)."""
  if KERNEL == "xla" or n_parts != 1 or softcap is not None or tile_rows_for(n_rows) is None:
    return False
  if KERNEL == "interpret":
    return True
  active = pt.active_rules()
  one_device = active is None or active.mesh.size == 1
  return one_device and compile_platform() == "tpu"


def _kernel(h_ref, w_ref, y_ref, m_ref, l_ref, t_ref, a_ref, *, columns, tile_columns,
            vocab_axis, accuracy):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    t_ref[...] = jnp.zeros(t_ref.shape, jnp.float32)
    a_ref[...] = jnp.zeros(a_ref.shape, jnp.int32)

  h = h_ref[...]
  w = w_ref[...].astype(h.dtype)
  contract = ((1,), (1,)) if vocab_axis == 0 else ((1,), (0,))
  z = jax.lax.dot_general(h, w, (contract, ((), ())), preferred_element_type=jnp.float32)
  cols = j * tile_columns + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
  # Columns past `columns`: a padded vocabulary's, or the last tile's reads past the weight.
  valid = cols < columns
  z = jnp.where(valid, z, -jnp.inf)
  m_old = m_ref[...]  # (rows, 128), every lane the same
  z_max = jnp.max(z, axis=1, keepdims=True)
  m_new = jnp.maximum(m_old, z_max)
  sum_exp = jnp.sum(jnp.exp(z - m_new[:, :1]), axis=1, keepdims=True)
  l_ref[...] = l_ref[...] * jnp.exp(m_old - m_new) + sum_exp
  m_ref[...] = m_new
  hit = (cols == y_ref[...][:, :1]) & valid
  t_ref[...] = t_ref[...] + jnp.sum(jnp.where(hit, z, 0.0), axis=1, keepdims=True)
  if accuracy:  # the first maximum: the earliest column of this tile's, kept if strictly higher
    first = jnp.min(jnp.where(z == z_max, cols, _NO_COLUMN), axis=1, keepdims=True)
    a_ref[...] = jnp.where(z_max > m_old, first, a_ref[...])


def ce_stats(w, vocab_axis: int, h_NxD, dtype, targets_N, columns: int,
             accuracy: bool) -> dict[str, jax.Array]:
  """{'m1', 'l1', 'target'} (and 'best', 'arg' with accuracy) per position, as
  vocab_slices._stats carries them: the fp32 logits' maximum over the first `columns` columns,
  the sum of exp(logit - maximum), the target's logit (0 for a target outside them), and the
  first argmax. w: (V, D) at vocab_axis 0, (D, V) at 1."""
  V = w.shape[vocab_axis]
  return _ce_stats(w, h_NxD.astype(jnp.dtype(dtype)), targets_N.astype(jnp.int32),
                   vocab_axis=vocab_axis, columns=columns, accuracy=accuracy,
                   interpret=KERNEL == "interpret", tn=tile_rows_for(h_NxD.shape[0]),
                   tv=min(TILE_COLUMNS, -(-V // LANES) * LANES))


@functools.partial(jax.jit, static_argnames=("vocab_axis", "columns", "accuracy", "interpret",
                                             "tn", "tv"))
def _ce_stats(w, h_NxD, targets_N, *, vocab_axis, columns, accuracy, interpret, tn, tv):
  N, D = h_NxD.shape
  V = w.shape[vocab_axis]
  grid = (N // tn, pl.cdiv(V, tv))
  w_spec = (pl.BlockSpec((tv, D), lambda i, j: (j, 0)) if vocab_axis == 0
            else pl.BlockSpec((D, tv), lambda i, j: (0, j)))
  stat_spec = pl.BlockSpec((tn, LANES), lambda i, j: (i, 0))
  shapes = [jax.ShapeDtypeStruct((N, LANES), jnp.float32)] * 3 + [
      jax.ShapeDtypeStruct((N, LANES), jnp.int32)]
  kernel = functools.partial(_kernel, columns=columns, tile_columns=tv, vocab_axis=vocab_axis,
                             accuracy=accuracy)
  y_NxL = jnp.broadcast_to(targets_N[:, None], (N, LANES))
  m, l, t, a = pl.pallas_call(
      kernel, grid=grid,
      in_specs=[pl.BlockSpec((tn, D), lambda i, j: (i, 0)), w_spec, stat_spec],
      out_specs=[stat_spec] * 4, out_shape=shapes,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=VMEM_LIMIT_BYTES),
      interpret=interpret)(h_NxD, w, y_NxL)
  out = {"m1": m[:, 0], "l1": l[:, 0], "target": t[:, 0]}
  if accuracy:
    out.update(best=out["m1"], arg=a[:, 0])
  return out
