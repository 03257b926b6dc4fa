"""The output layer as the vocabulary slices read it (vocab_slices.py): its matmuls (the main
weight, tied (V, D) or untied (D, V), and the extra ones a LoRA adapter adds), the fp32 logits
of one slice of columns from them, and how the vocabulary is cut into slices (their size from a
memory budget; the last one shifted back to end at the vocabulary, its overlap and a padded
vocabulary's columns past the tokens masked out). Apart from the engine so that what rides the
slices (slice_divergences, slice_buckets, slice_metrics) and the engine's passes share one
geometry.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

SLICE_BUDGET_BYTES = 256 * 2**20  # fp32 logits of one model for one slice, all positions


@dataclasses.dataclass(frozen=True)
class Head:
  """A plain output layer: `weight` (V, D) when `vocab_axis` is 0 (a tied embedding), (D, V)
  when 1; logits in fp32 from operands cast to `dtype`, then soft-capped when `softcap`."""

  weight: jax.Array
  vocab_axis: int
  dtype: str
  softcap: float | None = None
  # The tokenizer's ids: columns at or past it are a padded vocabulary's, left out of every
  # softmax (framework/token_rows.py); None: every column is a token.
  token_rows: int | None = None
  # Further matmuls summed into the logits before the soft-cap: (input (N, K), weight (K, V))
  # pairs, e.g. a LoRA adapter's (scaling * dropout(h) @ A, B). Their inputs are flat like h.
  more: tuple = ()

  @property
  def vocab(self) -> int:
    return self.weight.shape[self.vocab_axis]

  @property
  def columns(self) -> int:
    """How many columns the losses count: the token rows, at most the vocabulary."""
    return self.vocab if self.token_rows is None else min(self.vocab, int(self.token_rows))


def logits(weight_slices, hs, vocab_axes, dtype, softcap):
  """fp32 logits of one slice: softcap(sum of each part's h @ weight slice)."""
  dt = jnp.dtype(dtype)
  z = None
  for w, h, axis in zip(weight_slices, hs, vocab_axes):
    eq = "ND,SD->NS" if axis == 0 else "ND,DS->NS"
    z_i = jnp.einsum(eq, h.astype(dt), w.astype(dt), preferred_element_type=jnp.float32)
    z = z_i if z is None else z + z_i
  if softcap is not None:
    z = softcap * jnp.tanh(z / softcap)
  return z


def parts(head: Head, h_NxD):
  """(weights, inputs, vocab axes) of the head's matmuls, the main one first."""
  weights = (head.weight,) + tuple(w for _, w in head.more)
  inputs = (h_NxD,) + tuple(x for x, _ in head.more)
  return weights, inputs, (head.vocab_axis,) + (1,) * len(head.more)


def sliced_parts(ws, start, size, axes):
  return tuple(jax.lax.dynamic_slice_in_dim(w, start, size, a) for w, a in zip(ws, axes))


def slice_size_for(tokens: int, vocab: int, requested: int = 0) -> int:
  """Columns per slice: `requested`, or the most whose fp32 logits for `tokens` positions fit the
  budget, a multiple of 128 (a TPU lane tile), at most the vocabulary."""
  size = requested or max(128, SLICE_BUDGET_BYTES // (4 * max(tokens, 1)) // 128 * 128)
  return int(min(size, vocab))


def slice_count(tokens: int, vocab: int, requested: int = 0) -> int:
  """How many slices the losses over `tokens` positions and `vocab` columns take."""
  return math.ceil(vocab / slice_size_for(tokens, vocab, requested))


def slices(vocab: int, size: int):
  """(count, starts): the last slice is shifted back to end at `vocab` (no padding copy); the
  columns it shares with the one before are masked out of it."""
  count = math.ceil(vocab / size)
  starts = jnp.minimum(jnp.arange(count) * size, vocab - size)
  return count, starts


def new_columns(j, start, size, columns: int):
  """Which columns of slice j (starting at `start`) count: no earlier slice covered them, and
  they are below `columns` (a padded vocabulary's columns past the tokens never count)."""
  cols = start + jnp.arange(size)
  return (cols >= j * size) & (cols < columns)
