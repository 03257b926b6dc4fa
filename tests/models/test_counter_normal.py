"""The counter-based Gaussian init (models/counter_normal.py) against numpy's rendering of the
same recipe, against N(0, 1), and in the models: distinct per scanned layer, N(0, stddev) where
normal_param says so, deterministic by seed."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from distillax.errors import ConfigError
from distillax.models import counter_normal as cn
from distillax.models.init import create_model
from distillax.models.presets import get_preset


def test_words_and_values_equal_numpys_rendering():
  key = jax.random.key(7)
  k0, k1 = (int(x) for x in jax.random.key_data(key))
  shape = (5, 3, 257)  # a size that is no power of two, three axes
  w1, _ = jax.jit(lambda k: cn.counter_words(k, shape))(key)
  values = jax.jit(lambda k: cn.counter_normal(k, shape))(key)
  ref_w1, ref_values = cn.reference_normal(k0, k1, shape)
  np.testing.assert_array_equal(np.asarray(w1), ref_w1)  # integer words: bit for bit
  # float32 log, sqrt and the cosine polynomial against float64
  np.testing.assert_allclose(np.asarray(values), ref_values, rtol=0, atol=2e-6)


def test_the_cosine_polynomial_matches_numpy_on_its_quarter():
  x = np.linspace(0.0, math.pi / 2, 100_001)
  p = sum(c * x ** (2 * i) for i, c in enumerate(cn.COS_COEFFS))
  assert np.abs(p - np.cos(x)).max() < 1e-9


def test_a_million_values_are_standard_normal():
  values = np.asarray(jax.jit(lambda k: cn.counter_normal(k, (1024, 1024)))(jax.random.key(0)))
  values = values.ravel().astype(np.float64)
  n = values.size
  assert abs(values.mean()) < 4 / math.sqrt(n)  # four standard errors
  assert abs(values.std() - 1.0) < 4 / math.sqrt(2 * n)
  assert abs(stats.skew(values)) < 4 * math.sqrt(6 / n)
  assert abs(stats.kurtosis(values)) < 4 * math.sqrt(24 / n)
  # Kolmogorov-Smirnov against N(0, 1): below the 1% critical value, 1.63 / sqrt(n)
  assert stats.kstest(values, "norm").statistic < 1.63 / math.sqrt(n)


def test_keys_of_every_impl_give_words_and_a_huge_parameter_is_refused():
  for impl in ("threefry2x32", "rbg"):
    a, b = cn.key_words(jax.random.key(1, impl=impl)), cn.key_words(jax.random.key(2, impl=impl))
    assert a[0].dtype == jnp.uint32 and (int(a[0]), int(a[1])) != (int(b[0]), int(b[1]))
  with pytest.raises(ConfigError, match="more than 2"):
    jax.eval_shape(lambda: cn.counter_normal(jax.random.key(0), (2**16, 2**16 + 1)))


def test_scanned_layers_draw_their_own_values_with_the_preset_stddevs():
  cfg = get_preset("tiny", scan_layers=True, num_layers=4, embed_dim=128, mlp_dim=256)
  model = create_model(cfg, seed=5)
  up = np.asarray(model.layers.mlp.up[...])  # (layers, D, F), stddev D^-0.5
  assert up.shape == (4, 128, 256)
  for i in range(4):
    assert abs(up[i].std() * math.sqrt(128) - 1.0) < 0.02  # 32k values: SE of the std 0.4%
    for j in range(i):
      assert abs(np.corrcoef(up[i].ravel(), up[j].ravel())[0, 1]) < 0.02  # SE 0.006
  again = create_model(cfg, seed=5)
  np.testing.assert_array_equal(np.asarray(again.layers.mlp.up[...]), up)
  other = np.asarray(create_model(cfg, seed=6).layers.mlp.up[...])
  assert abs(np.corrcoef(other.ravel(), up.ravel())[0, 1]) < 0.01
  assert np.asarray(model.embedder.embedding[...]).std() == pytest.approx(0.02, rel=0.02)
