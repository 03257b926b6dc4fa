"""Shared pieces of the quantization tests: an independent numpy quantizer (written from the
formulas, not from qwix) and synthetic tokens and batches. Their models are tests.support.models'
TINY / TINY1 with FAN_IN weights."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

# The NF4 code book of the QLoRA paper (Dettmers et al. 2023, appendix E).
NF4_CODES = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                      -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                      0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                      0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                      0.7229568362236023, 1.0], np.float32)


def tokens(batch=2, length=12, vocab=128, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


# ---- numpy reference quantizer -------------------------------------------------------------------

def _tiles(w, axis, tile):
  """w with `axis` split into (n_tiles, tile) so reductions can run per tile."""
  shape = list(w.shape)
  shape[axis:axis + 1] = [shape[axis] // tile, tile]
  return w.reshape(shape)


def np_fake_quant(w, qtype, reduce_axes, tile=None, tile_axis=None):
  """Absmax quantize-dequantize of a float32 array, reducing over `reduce_axes` (the contracted
  axes), tiles of `tile` along `tile_axis`. Symmetric bounds: int8 127.5, int4 7.5 (the 'max
  bucket extended by half a step' convention), nf4 1.0, fp8 e4m3 448."""
  w = np.asarray(w, np.float32)
  if tile:
    w_t = _tiles(w, tile_axis, tile)
    shifted = [a + 1 if a >= tile_axis else a for a in reduce_axes if a != tile_axis]
    absmax = np.max(np.abs(w_t), axis=tuple(shifted + [tile_axis + 1]), keepdims=True)
  else:
    w_t = w
    absmax = np.max(np.abs(w), axis=tuple(reduce_axes), keepdims=True)
  bound = {"int8": 127.5, "int4": 7.5, "nf4": 1.0, "float8_e4m3fn": 448.0}[qtype]
  # XLA folds the division by a constant into a multiply by its reciprocal; so does this.
  scale = (absmax * np.float32(1.0 / bound)).astype(np.float32)
  scale = np.where(scale < np.sqrt(np.finfo(np.float32).tiny), np.float32(1), scale)
  x = w_t * (np.float32(1) / scale)  # likewise for the division by a broadcast scale
  if qtype == "int8":
    q = np.clip(np.round(x), -128, 127)
  elif qtype == "int4":
    q = np.clip(np.round(x), -8, 7)
  elif qtype == "nf4":
    q = NF4_CODES[np.argmin(np.abs(x[..., None] - NF4_CODES), axis=-1)]
  else:
    q = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  return (q * scale).reshape(w.shape).astype(np.float32)


# ---- a learnable synthetic distribution ----------------------------------------------------------

def markov_table(vocab: int, successors: int, seed: int) -> np.ndarray:
  """A sparse bigram table: each token has `successors` likely next tokens (learnable, and a
  known floor: the entropy rate)."""
  rng = np.random.default_rng(seed)
  table = np.full((vocab, vocab), 1e-3)
  for v in range(vocab):
    nxt = rng.choice(vocab, successors, replace=False)
    table[v, nxt] = rng.dirichlet(np.ones(successors)) * 10
  return table / table.sum(1, keepdims=True)


def markov_batches(table, n, batch, length, seed):
  rng = np.random.default_rng(seed)
  vocab = table.shape[0]
  cdf = np.cumsum(table, axis=1)
  out = []
  for _ in range(n):
    seq = np.zeros((batch, length + 1), np.int32)
    seq[:, 0] = rng.integers(0, vocab, batch)
    for t in range(length):
      u = rng.random(batch)[:, None]
      seq[:, t + 1] = np.minimum((u > cdf[seq[:, t]]).sum(1), vocab - 1)
    out.append({"inputs_BxL": seq[:, :-1], "targets_BxL": seq[:, 1:],
                "loss_mask_BxL": np.ones((batch, length), np.float32)})
  return out
