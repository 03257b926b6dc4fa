"""LogitKD against direct float64 numpy computations on small random logits."""

import jax.numpy as jnp
import numpy as np
import pytest

from distillax.distill import DistillInputs, LogitKD, divergence
from distillax.errors import ConfigError
from distillax.models.transformer import ModelOutput
from tests.distill import helpers as h

B, L, V = 2, 5, 11


def random_case(seed=0, scale=3.0):
  rng = np.random.default_rng(seed)
  s = (rng.normal(size=(B, L, V)) * scale).astype(np.float32)
  t = (rng.normal(size=(B, L, V)) * scale).astype(np.float32)
  targets = rng.integers(0, V, (B, L)).astype(np.int32)
  mask = np.ones((B, L), np.float32)
  mask[0, -2:] = 0
  mask[1, 1] = 0
  return s, t, targets, mask


def inputs_of(s, t, targets, mask):
  out = lambda x: ModelOutput(logits_BxLxV=jnp.asarray(x), final_hidden_BxLxD=jnp.zeros((B, L, 4)))
  batch = {"inputs_BxL": jnp.zeros((B, L), jnp.int32), "targets_BxL": jnp.asarray(targets),
           "loss_mask_BxL": jnp.asarray(mask)}
  return DistillInputs(batch=batch, student=out(s), teacher=out(t))


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("top_k", [None, 4])
def test_value_matches_numpy(kind, top_k):
  s, t, targets, mask = random_case(seed=1)
  strategy = LogitKD(temperature=1.7, alpha=0.6, divergence=kind, beta=0.3, top_k=top_k,
                     weight=2.5)
  loss, sums = strategy.loss_sums(inputs_of(s, t, targets, mask))
  ref_tok, ref_div = h.np_logit_kd(s.reshape(-1, V), t.reshape(-1, V), targets.reshape(-1),
                                   temperature=1.7, alpha=0.6, divergence=kind, beta=0.3,
                                   top_k=top_k)
  keep = mask.reshape(-1) > 0
  np.testing.assert_allclose(float(sums["logit_kd"]), ref_tok[keep].sum(), rtol=1e-5)
  np.testing.assert_allclose(float(sums["logit_kd_divergence"]), ref_div[keep].sum(), rtol=1e-5)
  np.testing.assert_allclose(float(loss), 2.5 * ref_tok[keep].sum(), rtol=1e-5)


def test_padding_cannot_leak():
  s, t, targets, mask = random_case(seed=2)
  ref = LogitKD(top_k=3).loss_sums(inputs_of(s, t, targets, mask))[0]
  s_bad, t_bad = s.copy(), t.copy()
  s_bad[mask == 0] = np.nan
  t_bad[mask == 0] = 1e30
  targets_bad = targets.copy()
  targets_bad[mask == 0] = V - 1
  got = LogitKD(top_k=3).loss_sums(inputs_of(s_bad, t_bad, targets_bad, mask))[0]
  np.testing.assert_allclose(float(got), float(ref), rtol=1e-6)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_top_k_equal_to_vocab_is_full_kd(kind):
  s, t, targets, mask = random_case(seed=3)
  full = LogitKD(divergence=kind).loss_sums(inputs_of(s, t, targets, mask))[0]
  top_all = LogitKD(divergence=kind, top_k=V).loss_sums(inputs_of(s, t, targets, mask))[0]
  np.testing.assert_allclose(float(top_all), float(full), rtol=1e-6)


def test_top_k_rest_bucket_differs_from_renormalising():
  """The rest bucket is part of the loss: a top-k loss is not the renormalised top-k KL."""
  s, t, targets, mask = random_case(seed=4)
  got = LogitKD(alpha=1.0, temperature=1.0, top_k=3).loss_sums(inputs_of(s, t, targets, mask))[0]
  idx = np.argsort(-t.reshape(-1, V), -1)[:, :3]
  p = np.take_along_axis(np.exp(h.np_log_softmax(t.reshape(-1, V))), idx, -1)
  q = np.take_along_axis(np.exp(h.np_log_softmax(s.reshape(-1, V))), idx, -1)
  renorm = h.np_kl(p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True))
  assert abs(float(got) - renorm[mask.reshape(-1) > 0].sum()) > 1e-2


def test_jsd_half_is_symmetric_and_bounded():
  s, t, _, _ = random_case(seed=5)
  ls = jnp.asarray(h.np_log_softmax(s.reshape(-1, V)), jnp.float32)
  lt = jnp.asarray(h.np_log_softmax(t.reshape(-1, V)), jnp.float32)
  ab = divergence("jsd", lt, ls, 0.5)
  ba = divergence("jsd", ls, lt, 0.5)
  np.testing.assert_allclose(np.asarray(ab), np.asarray(ba), rtol=1e-5, atol=1e-7)
  assert np.all(np.asarray(ab) <= np.log(2) + 1e-6) and np.all(np.asarray(ab) >= 0)
  np.testing.assert_allclose(
      np.asarray(ab), h.np_divergence("jsd", np.exp(h.f64(lt)), np.exp(h.f64(ls)), 0.5),
      rtol=1e-5, atol=1e-7)
  # Away from 0.5 the roles matter: beta weights the TEACHER's KL to the mixture.
  skew_ab = np.asarray(divergence("jsd", lt, ls, 0.2))
  np.testing.assert_allclose(
      skew_ab, h.np_divergence("jsd", np.exp(h.f64(lt)), np.exp(h.f64(ls)), 0.2), rtol=1e-5,
      atol=1e-7)
  assert not np.allclose(skew_ab, np.asarray(divergence("jsd", ls, lt, 0.2)), rtol=1e-3)


def test_alpha_one_is_pure_kd_and_zero_is_pure_ce():
  s, t, targets, mask = random_case(seed=6)
  keep = mask.reshape(-1) > 0
  pure_ce = LogitKD(alpha=0.0).loss_sums(inputs_of(s, t, targets, mask))[0]
  ce = -np.take_along_axis(h.np_log_softmax(s.reshape(-1, V)), targets.reshape(-1, 1), -1)[:, 0]
  np.testing.assert_allclose(float(pure_ce), ce[keep].sum(), rtol=1e-5)
  pure_kd = LogitKD(alpha=1.0, temperature=3.0).loss_sums(inputs_of(s, t, targets, mask))[0]
  p = np.exp(h.np_log_softmax(t.reshape(-1, V) / 3.0))
  q = np.exp(h.np_log_softmax(s.reshape(-1, V) / 3.0))
  np.testing.assert_allclose(float(pure_kd), 9.0 * h.np_kl(p, q)[keep].sum(), rtol=1e-5)


@pytest.mark.parametrize("kwargs", [
    dict(divergence="kl"), dict(divergence="jsd", beta=0.0), dict(divergence="jsd", beta=1.0),
    dict(alpha=1.5), dict(temperature=0.0), dict(top_k=0), dict(top_k=2.5), dict(weight=-1.0),
    dict(name=""), dict(name="hard_ce"),
])
def test_bad_settings_raise(kwargs):
  with pytest.raises(ConfigError):
    LogitKD(**kwargs)
