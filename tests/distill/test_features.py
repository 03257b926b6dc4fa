"""FeaturePooling and FeatureProjection (distill/features.py) against numpy."""

import numpy as np
import pytest
from flax import nnx

from distillax.distill import FeaturePooling, FeatureProjection, Projection
from tests.distill import helpers as h
from tests.distill.helpers import make_inputs


@pytest.mark.parametrize("kind", ["cosine", "mse"])
def test_feature_pooling_matches_numpy(kind):
  inputs, a = make_inputs(seed=3)
  layer_map = {0: 0, 2: 3}
  loss, sums = FeaturePooling(layer_map, loss=kind, weight=3.0).loss_sums(inputs)
  ref = sum(h.np_feature_term(kind, a["s_hidden"][s], h.np_pool(a["t_hidden"][t], 4), a["mask"])
            for s, t in layer_map.items())
  np.testing.assert_allclose(float(sums["feature_pooling"]), ref, rtol=1e-5)
  np.testing.assert_allclose(float(loss), 3.0 * ref, rtol=1e-5)


@pytest.mark.parametrize("kind", ["cosine", "mse"])
def test_feature_projection_matches_numpy(kind):
  strategy = FeatureProjection({1: 2, 2: 3}, loss=kind)
  projections = {"feature_projection": strategy.make_projections(4, 8, nnx.Rngs(0))}
  inputs, a = make_inputs(seed=4, projections=projections)
  term, _ = strategy.term_sums(inputs)
  kernels = [h.f64(p.kernel[...]) for p in projections["feature_projection"]]
  ref = sum(h.np_feature_term(kind, a["s_hidden"][s] @ k, a["t_hidden"][t], a["mask"])
            for k, (s, t) in zip(kernels, sorted({1: 2, 2: 3}.items())))
  np.testing.assert_allclose(float(term), ref, rtol=1e-5)


def test_projection_param_is_logically_named():
  p = Projection(4, 8, rngs=nnx.Rngs(0))
  assert p.kernel.get_metadata()["logical_axes"] == ("embed", None)
  assert p.kernel.shape == (4, 8)
