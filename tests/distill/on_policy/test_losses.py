"""On-policy losses: generalized JSD against a float64 NumPy reference (masks, temperature,
chunked and whole), its end points, and the sampled-token estimator's expected gradient
against the analytic reverse-KL gradient, by enumerating every token of a tiny vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.distill import LogitKD, make_distill_objective
from distillax.distill.logits import TokenLogits
from distillax.distill.on_policy.losses import (SAMPLE_LOGPROBS, GeneralizedJSD, SampledTokenKL,
                                                generalized_jsd)
from distillax.errors import ConfigError
from tests.distill import helpers as h


def np_gjsd(p, q, beta):
  """GKD's JSD(beta) from its definition; the end points are forward and reverse KL."""
  if beta == 0:
    return h.np_kl(p, q)
  if beta == 1:
    return h.np_kl(q, p)
  m = beta * p + (1 - beta) * q
  return beta * h.np_kl(p, m) + (1 - beta) * h.np_kl(q, m)


def _logits(student, teacher, batch):
  kwargs = dict(positions_BxL=batch["positions_BxL"], segment_ids_BxL=batch["segment_ids_BxL"])
  s = student(batch["inputs_BxL"], **kwargs).logits_BxLxV
  t = teacher(batch["inputs_BxL"], **kwargs).logits_BxLxV
  return np.asarray(s).reshape(-1, s.shape[-1]), np.asarray(t).reshape(-1, t.shape[-1])


@pytest.fixture(scope="module")
def models_and_batch():
  student, teacher = h.make_models(5)
  batch = h.to_jnp(h.make_batch(seed=5))
  return student, teacher, batch


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_gjsd_matches_numpy_with_masks_and_temperature(models_and_batch, beta, temperature):
  student, teacher, batch = models_and_batch
  s, t = _logits(student, teacher, batch)
  mask = np.asarray(batch["loss_mask_BxL"]).reshape(-1)
  assert 0 < mask.sum() < mask.size  # padding and masked tokens are in the batch
  p = np.exp(h.np_log_softmax(t / temperature))
  q = np.exp(h.np_log_softmax(s / temperature))
  want = np_gjsd(p, q, beta)[mask > 0].sum()
  strategy = GeneralizedJSD(beta=beta, temperature=temperature)
  for chunk in (None, 5):  # whole logits, and chunks of 5 tokens (18 tokens: a ragged end)
    out = make_distill_objective(strategy, chunk_size=chunk, metrics=False)(
        student, {"teacher": teacher}, batch, None)
    np.testing.assert_allclose(float(out.loss_sum), want, rtol=2e-5, err_msg=f"chunk={chunk}")
    np.testing.assert_allclose(float(out.sums["gjsd"]), want, rtol=2e-5)
    assert float(out.tokens) == mask.sum()


def test_gjsd_at_beta_0_and_t_1_is_logit_kd_forward_kl(models_and_batch):
  student, teacher, batch = models_and_batch
  ours = make_distill_objective(GeneralizedJSD(beta=0.0, temperature=1.0))(
      student, {"teacher": teacher}, batch, None)
  kd = make_distill_objective(LogitKD(temperature=1.0, alpha=1.0, divergence="forward_kl"))(
      student, {"teacher": teacher}, batch, None)
  np.testing.assert_allclose(float(ours.loss_sum), float(kd.loss_sum), rtol=1e-6)
  np.testing.assert_allclose(float(ours.loss_sum), float(kd.sums["logit_kd_divergence"]),
                             rtol=1e-6)


def test_gjsd_end_points_are_the_scaled_limits():
  """JSD(beta)/beta -> KL(P||Q) as beta -> 0 and JSD(beta)/(1-beta) -> KL(Q||P) as beta -> 1."""
  rng = np.random.default_rng(0)
  t = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(4, 7)) * 2, jnp.float32))
  s = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(4, 7)) * 2, jnp.float32))
  eps = 1e-3
  np.testing.assert_allclose(generalized_jsd(t, s, eps) / eps, generalized_jsd(t, s, 0.0),
                             rtol=2e-2)
  np.testing.assert_allclose(generalized_jsd(t, s, 1 - eps) / eps, generalized_jsd(t, s, 1.0),
                             rtol=2e-2)


def _np_reverse_kl_grad(s_logits, t_logits):
  """d KL(q || p) / d student logits, q = softmax(s), in closed form: q * (log q - log p - KL)."""
  log_q, log_p = h.np_log_softmax(s_logits), h.np_log_softmax(t_logits)
  q = np.exp(log_q)
  kl = np.sum(q * (log_q - log_p))
  return q * (log_q - log_p - kl)


@pytest.mark.parametrize("sampling_temperature", [1.0, 0.6, 1.7])
def test_sampled_estimator_expected_gradient_is_the_reverse_kl_gradient(sampling_temperature):
  """E_{y ~ q_s}[grad loss(y)] over every token y of an 11-token vocabulary, exactly; q_s is
  the sampler's distribution (tempered: the importance weight must correct it)."""
  V = 11
  rng = np.random.default_rng(7)
  s_logits = rng.normal(size=V).astype(np.float32) * 1.5
  t_logits = rng.normal(size=V).astype(np.float32) * 1.5
  sampler_logp = h.np_log_softmax(s_logits / sampling_temperature)
  strategy = SampledTokenKL()

  def weighted_loss(s):
    # Row y scores the sampled token y; the rows are the V possible samples, weighted by q_s.
    s_VxV = jnp.broadcast_to(s, (V, V))
    t_VxV = jnp.broadcast_to(jnp.asarray(t_logits), (V, V))
    tokens = {"targets_BxL": jnp.arange(V), SAMPLE_LOGPROBS: jnp.asarray(sampler_logp)}
    loss_V = strategy.shared_token_values(TokenLogits(s_VxV, t_VxV, tokens))["sampled_kl"]
    return jnp.sum(jnp.exp(jnp.asarray(sampler_logp)) * loss_V)

  grad = np.asarray(jax.grad(weighted_loss)(jnp.asarray(s_logits)), np.float64)
  np.testing.assert_allclose(grad, _np_reverse_kl_grad(s_logits, t_logits), atol=2e-6)
  # At the sampler's own temperature its value is the sampled estimate of reverse KL.
  if sampling_temperature == 1.0:
    log_q, log_p = h.np_log_softmax(s_logits), h.np_log_softmax(t_logits)
    np.testing.assert_allclose(float(weighted_loss(jnp.asarray(s_logits))),
                               np.sum(np.exp(log_q) * (log_q - log_p)), rtol=1e-5)


def test_sampled_estimator_needs_the_sampler_logprobs(models_and_batch):
  student, teacher, batch = models_and_batch
  with pytest.raises(ConfigError, match=SAMPLE_LOGPROBS):
    make_distill_objective(SampledTokenKL())(student, {"teacher": teacher}, batch, None)


@pytest.mark.parametrize("bad, match", [(dict(beta=1.5), "beta"), (dict(temperature=0), "temp")])
def test_gjsd_refuses_bad_fields(bad, match):
  with pytest.raises(ConfigError, match=match):
    GeneralizedJSD(**bad)
