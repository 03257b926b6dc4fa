"""The strategy protocol (distill/base.py): layer maps, composites, and the errors a config can
cause; the teacher side never gets a gradient."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from distillax.distill import (AttentionTransfer, Composite, DistillInputs, FeaturePooling,
                               FeatureProjection, LogitKD)
from distillax.errors import ConfigError
from tests.distill.helpers import make_inputs


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
    both = DistillInputs(batch=inputs.batch, student=s_out, teacher=t_out)
    return sum(w * leaf.term_sums(both)[0] for w, leaf in strategy.leaves())

  gs, gt = jax.grad(loss, argnums=(0, 1))(inputs.student, inputs.teacher)
  assert float(jnp.max(jnp.abs(gs.attention_probs))) > 0
  assert float(jnp.max(jnp.abs(gs.hidden_states))) > 0
  assert all(float(jnp.max(jnp.abs(x))) == 0 for x in jax.tree.leaves(gt))
