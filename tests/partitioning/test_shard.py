"""The partitioning core over the parameters of a real `Transformer` (tests/models/sharding.py).

Golden dumps of every model preset x strategy x mesh live with the models, in
tests/models/test_sharding_goldens.py; here the trees are inputs to describe, sufficiency,
optimizer shardings and activation constraints.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distillax import partitioning as pt
from distillax.errors import PartitioningError
from tests.models.sharding import param_tree, plan


@pytest.mark.parametrize("strategy,data,model,replicate_indivisible", [
    ("fsdp_tp", 4, 2, False), ("tp", 2, 4, True)])
def test_describe_matches_what_devices_actually_hold(strategy, data, model,
                                                    replicate_indivisible):
  """The plan's bytes per device are what each shard of the materialised tree holds, also where
  tiny's 2 kv heads fall back to replicated on a model axis of 4."""
  abstract, logical = param_tree("tiny")
  mesh = pt.create_mesh({"data": data, "model": model})
  rules = pt.rules_from_config({"strategy": strategy,
                                "replicate_indivisible": replicate_indivisible})
  rows = pt.describe(abstract, logical, mesh, rules)
  shardings = pt.tree_shardings(abstract, logical, mesh, rules)
  arrays = jax.jit(lambda: jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), abstract),
                   out_shardings=shardings)()
  for row, x in zip(rows, jax.tree.leaves(arrays)):
    assert tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec)) == row.mesh_spec
    for shard in x.addressable_shards:
      assert shard.data.nbytes == row.bytes_per_device, row.path
  table = pt.format_plan(rows, "plan")
  assert "layers/0/attn/q" in table and "per device" in table.splitlines()[-1]
  if strategy == "fsdp_tp":
    assert "(data, model, -)" in table


def test_sufficiency_check_flags_replicated_bytes():
  dp_rows = plan("tiny", "dp", 8, 1)
  with pytest.raises(PartitioningError, match=r"100.0% of parameter bytes are replicated.*embedder/embedding"):
    pt.check_sufficiency(dp_rows)
  assert pt.check_sufficiency(plan("tiny", "fsdp", 8, 1)).replicated_fraction == 0.0
  # tp leaves the small norm scales (embed) replicated: below the default 5% limit here.
  tp = pt.check_sufficiency(plan("tiny", "tp", 4, 2))
  assert 0 < tp.replicated_fraction < 0.05 and tp.ok
  assert all(r.path.endswith("scale") for r in tp.offenders)
  # On a model axis of 4, tiny's 2 kv heads fall back to replicated too: now it is too much.
  gqa = pt.check_sufficiency(plan("tiny", "tp", 2, 4, replicate_indivisible=True),
                             raise_on_failure=False)
  assert not gqa.ok and gqa.replicated_fraction > 0.05
  assert {r.path for r in gqa.offenders} >= {"layers/0/attn/k", "layers/0/attn/v"}


def test_optimizer_state_mirrors_parameter_shardings():
  abstract, logical = param_tree("tiny", num_layers=1)
  mesh = pt.create_mesh({"data": 4, "model": 2})
  p_sh = pt.tree_shardings(abstract, logical, mesh, pt.rules_from_config({"strategy": "fsdp_tp"}))
  tx = optax.adamw(1e-3)
  opt_abstract = jax.eval_shape(tx.init, abstract)
  o_sh = pt.optimizer_shardings(tx, opt_abstract, p_sh, mesh)
  params = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract),
                   out_shardings=p_sh)()
  opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
  mu = opt_state[0].mu
  assert mu["layers"][0]["mlp"]["up"].sharding.spec == P("data", "model")
  assert mu["lm_head"].sharding == p_sh["lm_head"]
  assert opt_state[0].count.sharding.spec == P()


def test_constrain_applies_only_inside_use_rules():
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rules = pt.rules_from_config({"strategy": "fsdp_tp"})
  x = jnp.ones((8, 4, 64))
  f = lambda x: pt.constrain(x * 2, ("batch", "length", "vocab"))
  assert pt.constrain(x, ("batch", "length", "vocab")) is x  # no rules: identity
  with pt.use_rules(mesh, rules):
    y = jax.jit(f)(x)
    with pt.no_rules():
      assert pt.constrain(x, ("batch", "length", "vocab")) is x
  assert y.sharding.spec == P("data", None, "model")
  np.testing.assert_array_equal(np.asarray(y), 2 * np.ones((8, 4, 64)))


class _Tiny(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.ones((16, 8)), logical_axes=("embed", "mlp"))
    self.b = nnx.Param(jnp.zeros((8,)), logical_axes=("mlp",))


def test_logical_tree_reads_variable_metadata():
  model = _Tiny()
  logical = pt.logical_tree(model)
  assert logical == {"w": P("embed", "mlp"), "b": P("mlp")}
  values = pt.pure_values(model)
  mesh = pt.create_mesh({"data": 2, "model": 4})
  sh = pt.tree_shardings(values, logical, mesh, pt.rules_from_config({"strategy": "fsdp_tp"}))
  assert sh["w"].spec == P("data", "model") and isinstance(sh["w"], NamedSharding)

  class Bad(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((4, 4)))
  with pytest.raises(PartitioningError, match=r"w \(shape \(4, 4\)\) has no logical axes"):
    pt.logical_tree(Bad())
