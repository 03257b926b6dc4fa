"""Pieces of the step: per-sequence vectorisation and micro-batch splitting."""

import jax
import jax.numpy as jnp
import numpy as np

from distillax.framework import losses
from distillax.framework.step import per_sequence, split_microbatches


def test_per_sequence_vmap_equals_the_batched_loss():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(4, 6, 11)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 11, (4, 6)), jnp.int32)
  mask = jnp.asarray(rng.random((4, 6)) > 0.3, jnp.float32)

  def one_sequence(logits_LxV, targets_L, mask_L):
    nll_L = losses.token_nll(logits_LxV[None], targets_L[None])[0]
    return jnp.sum(nll_L * mask_L), {"tokens": jnp.sum(mask_L)}

  loss, sums = per_sequence(one_sequence)(logits, targets, mask)
  want, _, tokens = losses.cross_entropy_sums(logits, targets, mask)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  assert float(sums["tokens"]) == float(tokens)
  # And against numpy directly.
  lp = np.asarray(jax.nn.log_softmax(logits))
  direct = -sum(lp[b, t, targets[b, t]] * mask[b, t] for b in range(4) for t in range(6))
  np.testing.assert_allclose(loss, direct, rtol=1e-5)


def test_microbatches_take_every_kth_row_and_cover_the_batch():
  batch = {"x": np.arange(8)[:, None] * np.ones((1, 3))}
  micro = split_microbatches(batch, 4)
  assert micro["x"].shape == (4, 2, 3)
  np.testing.assert_array_equal(micro["x"][:, :, 0], [[0, 4], [1, 5], [2, 6], [3, 7]])
