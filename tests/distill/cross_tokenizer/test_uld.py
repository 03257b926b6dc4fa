"""ULD's distance on integer-key sorts with a hand-written gradient (distill.cross_tokenizer.uld)
against the formulation it replaced (jnp.sort of the zero-padded rows, differentiated by JAX)
and against NumPy in float64."""

import jax
import jax.numpy as jnp
import numpy as np

from distillax.distill.cross_tokenizer.uld import uld_and_scale_grad, uld_distance


def _reference(p_s, p_t):
  V = max(p_s.shape[-1], p_t.shape[-1])
  pad = lambda p: jnp.sort(jnp.pad(p, ((0, 0), (0, V - p.shape[-1]))), -1)
  return jnp.sum(jnp.abs(pad(p_s) - pad(p_t)), -1)


def _probs(rng, rows, width, scale):
  return jax.nn.softmax(jnp.asarray(rng.normal(size=(rows, width)) * scale, jnp.float32), -1)


def test_value_gradients_and_scale_derivative_against_the_sorting_reference_and_numpy():
  rng = np.random.default_rng(0)
  for width_s, width_t in ((7, 11), (40, 24), (16, 16)):
    p_s, p_t = _probs(rng, 5, width_s, 3.0), _probs(rng, 5, width_t, 2.0)
    got = uld_distance(p_s, p_t)
    np.testing.assert_allclose(got, _reference(p_s, p_t), rtol=1e-6, atol=1e-7)
    V = max(width_s, width_t)
    s64 = np.pad(np.sort(np.asarray(p_s, np.float64))[:, ::-1], ((0, 0), (0, V - width_s)))
    t64 = np.pad(np.sort(np.asarray(p_t, np.float64))[:, ::-1], ((0, 0), (0, V - width_t)))
    np.testing.assert_allclose(got, np.abs(s64 - t64).sum(-1), rtol=1e-5, atol=1e-6)

    weights = jnp.asarray(rng.normal(size=5), jnp.float32)  # a cotangent per row
    loss = lambda f: (lambda a, b: jnp.sum(weights * f(a, b)))
    got_s, got_t = jax.grad(loss(uld_distance), (0, 1))(p_s, p_t)
    want_s, want_t = jax.grad(loss(_reference), (0, 1))(p_s, p_t)
    np.testing.assert_allclose(got_s, want_s, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_t, want_t, rtol=0, atol=1e-6)
    assert np.abs(np.asarray(want_s)).max() > 0.1

    # d ULD(exp(c) p_s, p_t) / dc at c = 0, against JAX's derivative of the reference.
    _, scale = uld_and_scale_grad(p_s, p_t)
    want = jax.vmap(jax.grad(lambda c, a, b: _reference(jnp.exp(c) * a[None], b[None])[0]),
                    (None, 0, 0))(0.0, p_s, p_t)
    np.testing.assert_allclose(scale, want, rtol=1e-5, atol=1e-6)


def test_a_permutation_is_no_change_and_the_same_distribution_is_zero():
  rng = np.random.default_rng(1)
  p = _probs(rng, 3, 9, 2.0)
  np.testing.assert_allclose(uld_distance(p[:, ::-1], p), 0, atol=1e-7)
  q = _probs(rng, 3, 5, 2.0)
  np.testing.assert_allclose(uld_distance(p[:, ::-1], q), uld_distance(p, q), atol=1e-7)
