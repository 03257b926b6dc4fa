"""AttentionTransfer, FeaturePooling and FeatureProjection against numpy, and their errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.distill import (AttentionTransfer, Composite, DistillInputs, FeaturePooling,
                               FeatureProjection, LogitKD, Projection)
from distillax.errors import ConfigError
from distillax.models.transformer import ModelOutput
from tests.distill import helpers as h

B, L = 2, 6


def causal_probs(rng, layers, heads):
  logits = rng.normal(size=(layers, B, heads, L, L)) * 2
  causal = np.tril(np.ones((L, L), bool))
  logits = np.where(causal, logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return (p / p.sum(-1, keepdims=True)).astype(np.float32)


def make_inputs(seed=0, s_heads=2, t_heads=4, s_layers=2, t_layers=3, ds=4, dt=8,
                projections=None):
  rng = np.random.default_rng(seed)
  mask = np.ones((B, L), np.float32)
  mask[1, -2:] = 0
  s_hidden = rng.normal(size=(s_layers + 1, B, L, ds)).astype(np.float32)
  t_hidden = rng.normal(size=(t_layers + 1, B, L, dt)).astype(np.float32)
  out = lambda hid, probs: ModelOutput(
      logits_BxLxV=jnp.zeros((B, L, 3)), final_hidden_BxLxD=jnp.asarray(hid[-1]),
      hidden_states=jnp.asarray(hid), attention_probs=jnp.asarray(probs))
  s_probs = causal_probs(rng, s_layers, s_heads)
  t_probs = causal_probs(rng, t_layers, t_heads)
  batch = {"inputs_BxL": jnp.zeros((B, L), jnp.int32), "targets_BxL": jnp.zeros((B, L), jnp.int32),
           "loss_mask_BxL": jnp.asarray(mask)}
  inputs = DistillInputs(batch=batch, student=out(s_hidden, s_probs),
                         teacher=out(t_hidden, t_probs), projections=projections)
  return inputs, dict(mask=mask, s_hidden=s_hidden, t_hidden=t_hidden, s_probs=s_probs,
                      t_probs=t_probs)


@pytest.mark.parametrize("kind", ["kl", "mse"])
def test_attention_transfer_groups_heads_and_matches_numpy(kind):
  inputs, a = make_inputs(seed=1)
  layer_map = {0: 1, 1: 2}
  loss, sums = AttentionTransfer(layer_map, loss=kind, weight=0.5).loss_sums(inputs)
  ref = h.np_attention_term(kind, a["s_probs"], a["t_probs"], layer_map, a["mask"])
  np.testing.assert_allclose(float(sums["attention_transfer"]), ref, rtol=1e-5)
  np.testing.assert_allclose(float(loss), 0.5 * ref, rtol=1e-5)


def test_attention_transfer_same_heads_kl_zero_on_itself():
  inputs, a = make_inputs(seed=2, s_heads=4, t_heads=4)
  same = DistillInputs(batch=inputs.batch, student=inputs.teacher, teacher=inputs.teacher)
  term, _ = AttentionTransfer({2: 2}).term_sums(same)
  assert abs(float(term)) < 1e-6
  term, _ = AttentionTransfer({0: 2}, loss="kl").term_sums(inputs)
  ref = h.np_attention_term("kl", a["s_probs"], a["t_probs"], {0: 2}, a["mask"])
  np.testing.assert_allclose(float(term), ref, rtol=1e-5)


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


def test_layer_map_from_config_strings():
  assert AttentionTransfer({"1": "2", "0": 1}).layer_map == ((0, 1), (1, 2))
  assert FeaturePooling([(2, 3)]).layer_map == ((2, 3),)


@pytest.mark.parametrize("make, match", [
    (lambda: AttentionTransfer({}), "empty"),
    (lambda: AttentionTransfer({-1: 0}), "non-negative"),
    (lambda: FeaturePooling({0: "x"}), "non-negative"),
    (lambda: AttentionTransfer({0: 1}, loss="cosine"), "choose one of"),
    (lambda: FeaturePooling({0: 1}, loss="kl"), "choose one of"),
    (lambda: LogitKD() + LogitKD(), "more than once"),
    (lambda: Composite(()), "at least one"),
])
def test_bad_construction_raises(make, match):
  with pytest.raises(ConfigError, match=match):
    make()


@pytest.mark.parametrize("strategy, kwargs, match", [
    (AttentionTransfer({2: 0}), {}, "student layer 2 does not exist"),
    (AttentionTransfer({0: 3}), {}, "teacher layer 3 does not exist"),
    (AttentionTransfer({0: 0}), dict(s_heads=3, t_heads=4), "not a multiple of student heads"),
    (FeaturePooling({3: 0}), {}, "student hidden state 3 does not exist"),
    (FeaturePooling({0: 4}), {}, "teacher hidden state 4 does not exist"),
    (FeaturePooling({0: 0}), dict(ds=3, dt=8), "not a multiple of the student width"),
    (FeatureProjection({0: 0}), {}, "has no projection"),
])
def test_bad_layer_maps_and_shapes_raise(strategy, kwargs, match):
  inputs, _ = make_inputs(**kwargs)
  with pytest.raises(ConfigError, match=match):
    strategy.term_sums(inputs)


def test_projection_width_mismatch_raises():
  strategy = FeatureProjection({0: 0})
  projections = {"feature_projection": strategy.make_projections(4, 6, nnx.Rngs(0))}
  inputs, _ = make_inputs(projections=projections)
  with pytest.raises(ConfigError, match="teacher_embed_dim=8"):
    strategy.term_sums(inputs)


def test_teacher_side_gets_no_gradient():
  """Through the strategies alone (no objective), the teacher's arrays get exactly zero grads."""
  inputs, _ = make_inputs(seed=5, s_heads=2, t_heads=4)
  strategy = AttentionTransfer({0: 1}) + FeaturePooling({1: 2}, loss="mse")

  def loss(s_out, t_out):
    return strategy.loss_sums(DistillInputs(batch=inputs.batch, student=s_out, teacher=t_out))[0]

  gs, gt = jax.grad(loss, argnums=(0, 1))(inputs.student, inputs.teacher)
  assert float(jnp.max(jnp.abs(gs.attention_probs))) > 0
  assert float(jnp.max(jnp.abs(gs.hidden_states))) > 0
  assert all(float(jnp.max(jnp.abs(x))) == 0 for x in jax.tree.leaves(gt))
