"""Shared pieces of the quantization tests: an independent numpy quantizer (written from the
formulas, not from qwix), numpy transcriptions of llama.cpp's q4_0 / q8_0 blocks, and synthetic
tokens and batches. Their models are tests.support.models'
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


# ---- llama.cpp's q4_0 / q8_0 blocks in numpy -----------------------------------------------------
# Written from ggml's C (quantize_row_q4_0_ref / quantize_row_q8_0_ref, and the x86
# quantize_row_q8_0 for activations), float32 step by step; test_ggml.py checks them against
# gguf.quants (llama.cpp's own numpy code) bit for bit, so the tests that run where gguf is not
# installed (the chip run, scripts/chip_tests.sh) compare with these.

GGML_BLOCK = 32


def awkward_weights(shape, seed):
  """Normal weights whose blocks span magnitudes (fp16 subnormal scales to large ones), with
  an all-zero block, a constant block and a block whose largest magnitude occurs with both
  signs (q4_0 must keep the first)."""
  rng = np.random.default_rng(seed)
  w = rng.normal(size=shape).astype(np.float32)
  flat = w.reshape(-1)
  for i, scale in enumerate((1e-7, 1e-4, 0.02, 3.0, 150.0)):
    flat[i * 40:(i + 1) * 40] *= np.float32(scale)
  flat[200:232] = 0
  flat[232:264] = np.float32(0.75)
  flat[264:296] = rng.normal(size=32).astype(np.float32) * 0.1
  flat[270], flat[280] = np.float32(-0.9), np.float32(0.9)
  return w


def gguf_rows(w, contract):
  """The weight as a GGUF [out, in] tensor: contracted axes (increasing) flattened as `in`."""
  free = [a for a in range(w.ndim) if a not in contract]
  return np.ascontiguousarray(np.transpose(w, free + list(contract)).reshape(
      -1, int(np.prod([w.shape[a] for a in contract]))))


def _c_roundf(x):
  """C's roundf: halves away from zero (the fractional part of a float32 is exact)."""
  a = np.abs(x)
  whole = np.floor(a)
  return np.sign(x) * (whole + (a - whole >= np.float32(0.5)))


def np_ggml_blocks(rows, qtype):
  """(fp16 scales (n, 1), the blocks' integers (n, 32) as float32: q8_0's codes, q4_0's codes
  minus 8) of float32 rows cut into blocks of 32, as ggml's reference quantizers write them."""
  blocks = np.asarray(rows, np.float32).reshape(-1, GGML_BLOCK)
  if qtype == "q8_0":
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
  else:  # q4_0: the first element of largest magnitude, sign kept, lands on code 0
    first = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[:, None], axis=-1)
    d = first / np.float32(-8)
  with np.errstate(divide="ignore"):
    inverse = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
  if qtype == "q8_0":
    codes = _c_roundf(blocks * inverse)
  else:
    codes = np.clip(np.trunc(blocks * inverse + np.float32(8.5)), 0, 15) - np.float32(8)
  # Integers, as ggml stores them: no -0 (a negative value that rounds to 0 is +0 there).
  return d.astype(np.float16), codes.astype(np.int32).astype(np.float32)


def np_ggml_rounded_rows(rows, qtype):
  """Rows (out, in) rounded to their ggml blocks and back: fp16 scale times code, float32."""
  scales, codes = np_ggml_blocks(rows, qtype)
  return (scales.astype(np.float32) * codes).reshape(np.shape(rows))


def np_ggml_rounded(w, qtype, contract):
  """A weight whose matmul contracts `contract`, rounded to ggml blocks in its own layout."""
  free = [a for a in range(w.ndim) if a not in contract]
  moved_shape = [w.shape[a] for a in free + list(contract)]
  rows = np_ggml_rounded_rows(gguf_rows(w, contract), qtype)
  return np.transpose(rows.reshape(moved_shape), np.argsort(free + list(contract)))


def np_cpu_q8_0(blocks):
  """llama.cpp's x86 quantize_row_q8_0 (ggml-cpu/arch/x86/quants.c), written from the C:
  multiplier 127 / amax, _mm256_round_ps to nearest even, fp16 scale amax / 127."""
  amax = np.abs(blocks).max(axis=-1, keepdims=True)
  with np.errstate(divide="ignore"):
    multiplier = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
  codes = np.rint(blocks * multiplier)
  return (amax / np.float32(127)).astype(np.float16).astype(np.float32) * codes


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
