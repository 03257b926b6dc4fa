"""Pieces of the step: the token losses it sums and micro-batch splitting."""

import jax.numpy as jnp
import numpy as np

from distillax.framework import losses
from distillax.framework.step import split_microbatches


def test_cross_entropy_sums_match_numpy():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(4, 6, 11)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 11, (4, 6)), jnp.int32)
  mask = jnp.asarray(rng.random((4, 6)) > 0.3, jnp.float32)
  loss, correct, tokens = losses.cross_entropy_sums(logits, targets, mask)
  x = np.asarray(logits, np.float64)
  lp = x - x.max(-1, keepdims=True)
  lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
  direct = -sum(lp[b, t, targets[b, t]] * mask[b, t] for b in range(4) for t in range(6))
  np.testing.assert_allclose(loss, direct, rtol=1e-5)
  assert float(tokens) == float(np.sum(mask))
  hits = np.asarray(jnp.argmax(logits, -1) == targets) * np.asarray(mask)
  assert float(correct) == float(hits.sum())


def test_microbatches_take_every_kth_row_and_cover_the_batch():
  batch = {"x": np.arange(8)[:, None] * np.ones((1, 3))}
  micro = split_microbatches(batch, 4)
  assert micro["x"].shape == (4, 2, 3)
  np.testing.assert_array_equal(micro["x"][:, :, 0], [[0, 4], [1, 5], [2, 6], [3, 7]])
