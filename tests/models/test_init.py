"""Sharded creation: parameters are born in their shards, with the values of a plain init."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import partitioning as pt
from distillax.models.presets import get_preset
from distillax.models.init import abstract_model, create_model, model_shardings
from tests.support.models import forward


def _params(model):
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return jax.tree_util.tree_flatten_with_path(params)[0]


@pytest.mark.parametrize("scan", [False, True])
def test_fsdp_no_device_holds_a_full_sharded_param(scan):
  cfg = get_preset("tiny", scan_layers=scan)
  mesh = pt.create_mesh({"data": 8, "model": 1})
  model = create_model(cfg, mesh=mesh, rules="fsdp", seed=3)
  # Sharded creation draws the same values as a plain one (checked once; compiles are slow).
  reference = {} if scan else {jax.tree_util.keystr(p): x
                               for p, x in _params(create_model(cfg, seed=3))}
  leaves = _params(model)
  assert leaves
  for path, x in leaves:
    # Every tiny parameter has an 'embed' dim, which fsdp shards 8 ways over 'data'.
    assert "data" in tuple(x.sharding.spec), (path, x.sharding.spec)
    for shard in x.addressable_shards:
      assert shard.data.shape != x.shape, path
      assert np.prod(shard.data.shape) * 8 == np.prod(x.shape), path
    if reference:
      np.testing.assert_array_equal(np.asarray(x), reference[jax.tree_util.keystr(path)])
  if scan:
    q = model.layers.attn.q
    assert q.get_metadata()["logical_axes"] == ("layers", "embed", "heads", "head_dim")
    assert tuple(q[...].sharding.spec) == (None, "data", None, None)


def test_tp_shards_heads_and_mlp_and_forward_matches_unsharded():
  cfg = get_preset("tiny_gemma")
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rules = pt.rules_from_config({"strategy": "fsdp_tp"})
  model = create_model(cfg, mesh=mesh, rules=rules, seed=1)
  assert tuple(model.layers[0].attn.q[...].sharding.spec) == ("data", "model", None)
  assert tuple(model.layers[0].mlp.down[...].sharding.spec) == ("model", "data")
  expected = model_shardings(model, mesh, rules)
  assert expected["layers"][0]["mlp"]["gate"].spec == model.layers[0].mlp.gate[...].sharding.spec
  tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, cfg.vocab_size)
  graphdef, state = nnx.split(model)

  @jax.jit
  def sharded_forward(state, tokens):
    with pt.use_rules(mesh, rules):
      return nnx.merge(graphdef, state)(tokens).logits_BxLxV

  sharded = sharded_forward(state, tokens)
  on_one_device = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), state)
  plain = forward(nnx.merge(graphdef, on_one_device), tokens).logits_BxLxV
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(plain), atol=1e-5)
  assert sharded.sharding.spec[0] == "data"  # the batch stays data-parallel


def test_param_dtype_is_respected():
  model = abstract_model(get_preset("tiny", param_dtype="bfloat16", scan_layers=True))
  assert all(x.dtype == jnp.bfloat16 for _, x in _params(model))
