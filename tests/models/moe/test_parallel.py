"""The experts' token exchange (models/moe/parallel.py) against the replicated ragged dispatch:
tokens routed only to experts held on other devices, values and gradients, under the rules that
switch it on; and the rules that leave it off."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax import partitioning as pt
from distillax.models.moe import layer as moe
from distillax.models.moe import kernels as moe_kernels
from distillax.models.moe import parallel as moe_parallel

D, F = 8, 4


def _experts(E, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]


def _cross_device_routing(T, E, n, k=2):
  """Token t lives on device t // (T / n) of the exchange and is routed to k experts of the
  devices after its own (expert e lives on device e // (E / n)): no token's expert is local."""
  per_device, E_local = T // n, E // n
  device_T = np.arange(T) // per_device
  experts = np.stack([((device_T + 1 + j) % n) * E_local + (np.arange(T) + j) % E_local
                      for j in range(k)], axis=1)
  assert not np.any(experts // E_local == device_T[:, None])
  weights = np.random.default_rng(1).uniform(0.1, 1.0, size=(T, k))
  return jnp.asarray(weights, jnp.float32), jnp.asarray(experts, jnp.int32)


@pytest.mark.parametrize("rules,E,gpt_oss", [
    # fsdp_ep on a (4, 2) mesh: experts over data (4 shards), the model axis left to GSPMD.
    ((("expert", "data"),), 4, False),
    # Experts over both axes (8 shards), one expert per device and k = 2: every token sends two
    # rows, to two other devices; with gpt-oss's expert biases and up activation.
    ((("expert", ("data", "model")),), 8, True),
])
def test_tokens_routed_to_experts_on_other_devices_match_the_replicated_dispatch(rules, E,
                                                                                  gpt_oss):
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rule_set = pt.RuleSet(rules + pt.preset("fsdp"))
  T = 16
  n = 4 if E == 4 else 8
  x = jnp.asarray(np.random.default_rng(2).normal(size=(T, D)), jnp.float32)
  weights, experts = _cross_device_routing(T, E, n)
  gate, up, down = _experts(E)
  rng = np.random.default_rng(7)
  biases = ([jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((E, F), (E, F), (E, D))]
            if gpt_oss else None)
  up_act = (lambda u: jnp.clip(u, -7.0, 7.0) + 1.0) if gpt_oss else None
  cotangent = jnp.asarray(np.random.default_rng(3).normal(size=(T, D)), jnp.float32)

  def replicated(x, w, g, u, d, b):
    routing = moe.Routing(w, experts, jnp.zeros((T, E)))
    return jnp.sum(moe.ragged_experts(x, routing, g, u, d, jax.nn.silu, b, up_act) * cotangent)

  def exchanged(x, w, g, u, d, b):
    with pt.use_rules(mesh, rule_set):
      where = pt.split_over("expert", E)
      assert where is not None and where.size == n
      out = moe_parallel.exchanged_experts(x, w, experts, g, u, d, jax.nn.silu, where,
                                           biases=b, up_act=up_act)
    return jnp.sum(out * cotangent)

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4, 5)))
  args = (x, weights, gate, up, down, biases)
  want_value, want_grads = grad(replicated)(*args)
  got_value, got_grads = grad(exchanged)(*args)
  np.testing.assert_allclose(got_value, want_value, rtol=1e-5)
  names = ("x", "weights", "gate", "up", "down", "biases")
  for got, want, name in zip(got_grads, want_grads, names):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)
  hlo = grad(exchanged).lower(*args).compile().as_text()
  assert len(re.findall(r"all-to-all\(", hlo)) >= 3  # rows out, expert ids out, results back


@pytest.mark.parametrize("impl", ["ragged", "tokamax"])
def test_token_count_not_divisible_by_the_shards_is_padded_and_cut(impl):
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rule_set = pt.rules_from_config({"strategy": "fsdp_ep"})
  T, E = 7, 4
  x = jnp.asarray(np.random.default_rng(4).normal(size=(T, D)), jnp.float32)
  routing = moe.route(jnp.asarray(np.random.default_rng(5).normal(size=(T, E)), jnp.float32),
                      2, "topk_softmax", False)
  weights = _experts(E, seed=6)
  want = moe.ragged_experts(x, routing, *weights, jax.nn.silu)

  @jax.jit
  def exchanged(x):
    with pt.use_rules(mesh, rule_set):
      return moe_parallel.run_experts(impl, None, x, routing, weights, jax.nn.silu)
  with moe_kernels.recorded_choices() as choices:
    got = exchanged(x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  (choice,) = choices
  assert choice.startswith(impl) and choice.endswith("experts split 4 ways over data (all_to_all)")


def test_split_over_asks_the_active_rules_only():
  mesh = pt.create_mesh({"data": 4, "model": 2})
  assert pt.split_over("expert", 4) is None  # no rules active: every backend but GSPMD jit
  for strategy, E, want in [("fsdp_ep", 4, ("data",)), ("ep_tp", 8, ("data",)),
                            ("fsdp", 4, None), ("dp", 4, None)]:
    with pt.use_rules(mesh, pt.rules_from_config({"strategy": strategy})):
      where = pt.split_over("expert", E)
    assert (where and where.axes) == want, strategy
  # Inside the per-data-worker region the data axis is manual and stripped from the rules.
  rules = pt.rules_from_config({"strategy": "fsdp_ep"}).without_mesh_axes(["data"])
  with pt.use_rules(mesh, rules):
    assert pt.split_over("expert", 4) is None
