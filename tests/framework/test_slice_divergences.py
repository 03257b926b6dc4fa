"""The jsd's per-column terms over a slice (framework/slice_divergences.py) against float64 numpy
where the float32 arithmetic is hardest: a wide vocabulary (log-probabilities near -log V = -12)
and a student close to its teacher, so lq - log M is a small difference of two large numbers.
The terms are formed from the logits' difference; as the difference of float32 log-probabilities
(the earlier form) they were off by ~1e-4 of the gradient's scale on a TPU's log/exp and by more
here on any float32 machine."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp

from distillax.framework import slice_divergences as sd
from tests.support import chip


def _case(seed, V=200_000, N=3, spread=3.0, gap=0.01):
  """(s, t) logits rounded to float32, as float64 (the reference starts from what the code sees)."""
  rng = np.random.default_rng(seed)
  s = rng.normal(0, spread, (N, V))
  t = s + gap * rng.normal(0, 1, (N, V))
  return (x.astype(np.float32).astype(np.float64) for x in (s, t))


def _numpy_jsd(s, t, T, beta):
  """(per-token jsd, (1 - beta) KL(Q || M), d jsd / d s, the sum of the jsd's column terms'
  magnitudes) in float64."""
  lq = s / T - logsumexp(s / T, axis=-1, keepdims=True)
  lp = t / T - logsumexp(t / T, axis=-1, keepdims=True)
  log_m = np.logaddexp(np.log(beta) + lp, np.log1p(-beta) + lq)
  q, p = np.exp(lq), np.exp(lp)
  student = (1 - beta) * q * (lq - log_m)
  jq = student.sum(-1)
  teacher = beta * p * (lp - log_m)
  magnitude = np.abs(teacher).sum(-1) + np.abs(student).sum(-1)
  return teacher.sum(-1) + jq, jq, (student - q * jq[:, None]) / T, magnitude


@pytest.mark.parametrize("T,beta,gap", [(1.0, 0.5, 0.01), (2.0, 0.1, 0.01), (1.0, 0.9, 1.0)])
def test_jsd_terms_and_gradient_meet_float64_on_a_wide_vocabulary(T, beta, gap):
  """Each within 1e-5 of float64's scale (on a TPU, whose exp/expm1/log1p are coarser:
  tests/support/chip.py): the jsd of the sum of the magnitudes of the column terms
  it adds up (float32 sums 200,000 of them), the gradient of its largest entry. The carried
  (1 - beta) KL(Q || M) is checked through the gradient: its error from the float32 normalisers
  (~(1 - beta) beta ulp(lse)) cancels there against the same shift of every column's term."""
  s, t = _case(0, gap=gap)
  want_jsd, _, want_grad, magnitude = _numpy_jsd(s, t, T, beta)
  lse = {"sT": jnp.asarray(logsumexp(s / T, axis=-1), jnp.float32),
         "t": jnp.asarray(logsumexp(t / T, axis=-1), jnp.float32)}
  s32, t32 = jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32)
  jsd, jq = sd.jsd_terms(s32, t32, jnp.ones(s.shape, bool), lse, T, beta)
  np.testing.assert_allclose(jsd, want_jsd, atol=chip.pick(1e-5, chip.F32) * magnitude.max())
  grad = sd.logit_grad("jsd", beta, s32, t32, {**lse, "jq": jq}, T)
  scale = np.abs(want_grad).max()
  chip.assert_close(grad, want_grad, atol=1e-5 * scale, tpu=chip.F32_GRADS)
  assert want_jsd.min() > 0 and np.abs(want_grad).max() > 0
