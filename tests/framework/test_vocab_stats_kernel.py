"""The cross-entropy statistics kernel (framework/vocab_stats_kernel.py) against the sliced
engine's own XLA pass over the slices, the unchanged path: the loss, its sums and the gradients
of the weight and hidden states, for a tied and an untied head, a padded vocabulary and ties
for the argmax; and the per-position statistics against float64 numpy. In Pallas' interpreter
on a CPU; on a TPU the chip run (scripts/chip_tests.sh) compiles it with Mosaic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.framework import vocab_slices, vocab_stats_kernel
from distillax.framework.slice_heads import Head
from tests.support import chip


@pytest.fixture
def kernel_as(monkeypatch):
  def use(kind):
    monkeypatch.setattr(vocab_stats_kernel, "KERNEL", kind)
  return use


def _problem(vocab_axis, V=700, D=32, N=256, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  w = jax.random.normal(k[0], (V, D) if vocab_axis == 0 else (D, V)) * 0.4
  h = jax.random.normal(k[1], (N, D))
  y = jax.random.randint(k[2], (N,), 0, V)
  mask = (jax.random.uniform(k[3], (N,)) > 0.2).astype(jnp.float32)
  return w, h, y, mask


def _loss_sums_grads(kind, kernel_as, w, h, y, mask, vocab_axis, dtype, token_rows=None):
  kernel_as(kind)
  spec = vocab_slices.Spec(accuracy=True, slice_size=256)

  def loss(w, h):
    head = Head(w, vocab_axis, dtype, token_rows=token_rows)
    return vocab_slices.token_sums(spec, head, h, y, mask)

  (value, sums), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, h)
  return value, sums, grads


@pytest.mark.parametrize("vocab_axis,token_rows,dtype", [
    (0, None, "float32"), (1, None, "float32"), (0, 650, "float32"), (1, 650, "bfloat16"),
    (0, None, "bfloat16")])
def test_loss_sums_and_gradients_equal_the_xla_pass(kernel_as, vocab_axis, token_rows, dtype):
  """On a CPU, in Pallas' interpreter: V = 700 in tiles of 128 (the last one past the weight's
  end), 256 positions in row tiles of 128; a padded table whose columns past 650 are no tokens;
  fp32 and bf16 compute. On the chip, the Mosaic kernel at its own tiles: V = 151,936 (Qwen3's
  table), width 256, 2048 positions. The same loss, sums and gradients as the XLA pass over
  slices of 256 columns: fp32 within 2e-6 relative on a CPU (the two sum their exponentials in
  another order) and chip.F32 of each array's scale on a TPU; bf16 matmul inputs within 1e-3
  of each array's scale (the same bf16 products, summed in another order)."""
  V, D, N = chip.pick((700, 32, 256), (151_936, 256, 2048))
  w, h, y, mask = _problem(vocab_axis, V, D, N)
  rows = token_rows and V - 50
  if rows:
    y = jnp.minimum(y, rows - 1)
  tiles = chip.pick((128, 128), (vocab_stats_kernel.TILE_ROWS, vocab_stats_kernel.TILE_COLUMNS))
  old = (vocab_stats_kernel.TILE_ROWS, vocab_stats_kernel.TILE_COLUMNS)
  vocab_stats_kernel.TILE_ROWS, vocab_stats_kernel.TILE_COLUMNS = tiles
  try:
    with chip.precision(dtype):
      got = _loss_sums_grads(chip.pick("interpret", "auto"), kernel_as, w, h, y, mask,
                             vocab_axis, dtype, rows)
  finally:
    vocab_stats_kernel.TILE_ROWS, vocab_stats_kernel.TILE_COLUMNS = old
  with chip.precision(dtype):
    want = _loss_sums_grads("xla", kernel_as, w, h, y, mask, vocab_axis, dtype, rows)
  names = ("loss", "nll", "correct", "d weight", "d hidden")
  pairs = zip((got[0], got[1]["nll"], got[1]["correct"], *got[2]),
              (want[0], want[1]["nll"], want[1]["correct"], *want[2]))
  for name, (g, w_) in zip(names, pairs):
    if dtype == "bfloat16":
      chip.assert_scaled(g, w_, 1e-3, name)
    else:
      chip.assert_close(g, w_, err_msg=name, rtol=2e-6, atol=2e-6 * float(jnp.max(jnp.abs(w_))))


def test_statistics_equal_float64_numpy_with_ties_for_the_argmax(kernel_as):
  """Each position's maximum, sum of exponentials, target logit and first argmax against numpy
  in float64, over a weight whose rows repeat (columns 3 and 3 + 128 * k tie, across tiles):
  the first of tied maxima wins, as jnp.argmax picks it; a target past `columns` adds 0."""
  kernel_as("interpret")
  V, D, N, columns = 640, 16, 128, 600
  base = jax.random.normal(jax.random.key(1), (128, D))
  w = jnp.tile(base, (V // 128, 1))  # every column's logits repeat every 128 columns
  h = jax.random.normal(jax.random.key(2), (N, D))
  y = jax.random.randint(jax.random.key(3), (N,), 0, V)
  old = (vocab_stats_kernel.TILE_ROWS, vocab_stats_kernel.TILE_COLUMNS)
  vocab_stats_kernel.TILE_ROWS, vocab_stats_kernel.TILE_COLUMNS = 128, 128
  try:
    got = vocab_stats_kernel.ce_stats(w, 0, h, "float32", y, columns, accuracy=True)
  finally:
    vocab_stats_kernel.TILE_ROWS, vocab_stats_kernel.TILE_COLUMNS = old
  z = (np.asarray(h, np.float64) @ np.asarray(w, np.float64).T)[:, :columns]
  m = z.max(axis=1)
  np.testing.assert_allclose(got["m1"], m, rtol=1e-6)
  np.testing.assert_allclose(got["l1"], np.exp(z - m[:, None]).sum(axis=1), rtol=1e-5)
  yn = np.asarray(y)
  target = np.where(yn < columns, z[np.arange(N), np.minimum(yn, columns - 1)], 0.0)
  np.testing.assert_allclose(got["target"], target, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got["arg"], np.argmax(z, axis=1))
  assert int(jnp.max(got["arg"])) < 128  # the tie went to the first tile every time


def test_plan_says_when_the_kernel_runs(kernel_as):
  """vocab_slices.describe (what plan reports as the token loss) names the kernel where the CE
  takes it, and not where a teacher's head rides the same pass (KD, or a KD eval's metrics with
  no KD weight), a given top-k does, or the kernel is off."""
  head = Head(jnp.zeros((700, 32)), 0, "float32")
  ce = vocab_slices.Spec(accuracy=True)
  metrics_only = vocab_slices.Spec(ce_weight=0.0, accuracy=True, metrics=True)
  kernel_as("interpret")
  assert "Pallas kernel" in vocab_slices.describe(ce, head, 256)
  assert "Pallas kernel" not in vocab_slices.describe(ce, head, 256, teacher=True)
  assert "Pallas kernel" not in vocab_slices.describe(metrics_only, head, 256, teacher=True)
  assert "Pallas kernel" not in vocab_slices.describe(vocab_slices.Spec(top_k=8), head, 256)
  assert "Pallas kernel" not in vocab_slices.describe(ce, head, 100)  # no row tile divides it
  kernel_as("xla")
  assert vocab_slices.describe(ce, head, 256) == (
      "sliced (vocabulary slices: 1 of 700 columns x 256 positions)")
