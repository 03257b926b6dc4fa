"""The mixture-of-experts block: routing rules, ties, and the ragged dispatch against the dense
reference for values and gradients, alone and inside a model (unrolled and scanned layers)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.errors import ConfigError
from distillax.models.moe import layer as moe
from distillax.models.layers import activations
from distillax.models.presets import get_preset
from distillax.models.transformer import with_config
from tests.support.models import forward, random_model

T, D, E, F, K = 7, 6, 5, 4, 2


def _arrays(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(T, D))
  logits = rng.normal(size=(T, E))
  logits[:, 3] = -50.0  # expert 3 gets no token: an empty group in the grouped matmul
  gate, up = rng.normal(size=(E, D, F)), rng.normal(size=(E, D, F))
  down = rng.normal(size=(E, F, D))
  return [jnp.asarray(a, jnp.float32) for a in (x, logits, gate, up, down)]


@pytest.mark.parametrize("kind,norm,gpt_oss", [
    ("softmax_topk", False, False), ("softmax_topk", True, False), ("topk_softmax", False, False),
    # gpt-oss: gate/up/down biases and the clamped SwiGLU (limit 0.8: the clamps bite)
    ("topk_softmax", False, True)])
def test_ragged_dispatch_equals_dense_reference_in_values_and_gradients(kind, norm, gpt_oss):
  args = _arrays()
  rng = np.random.default_rng(2)
  biases = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((E, F), (E, F), (E, D))]
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(T, D)), jnp.float32)
  act, up_act = jax.nn.silu, None
  if gpt_oss:
    act, up_act = activations(get_preset("tiny", mlp_activation="clamped_swiglu",
                                         swiglu_limit=0.8))

  def loss(dispatch, x, logits, gate, up, down, biases):
    routing = moe.route(logits, K, kind, norm)
    out = dispatch(x, routing, gate, up, down, act, biases if gpt_oss else None, up_act)
    return jnp.sum(out * cotangent)

  grads = {}
  for name, dispatch in (("ragged", moe.ragged_experts), ("dense", moe.dense_experts)):
    fn = jax.jit(jax.value_and_grad(lambda *a, d=dispatch: loss(d, *a),
                                    argnums=(0, 1, 2, 3, 4, 5)))
    grads[name] = fn(*args, biases)
  (v_r, g_r), (v_d, g_d) = grads["ragged"], grads["dense"]
  np.testing.assert_allclose(v_r, v_d, rtol=1e-5, atol=1e-5)
  for a, b, name in zip(jax.tree.leaves(g_r), jax.tree.leaves(g_d),
                        ("x", "logits", "gate", "up", "down", "gate_b", "up_b", "down_b")):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
  if gpt_oss:  # the down bias of the expert no token picks learns nothing, the others do
    assert float(jnp.abs(g_r[5][2][3]).max()) == 0.0 < float(jnp.abs(g_r[5][2]).max())
  assert float(jnp.abs(g_r[0]).max()) > 0 and float(jnp.abs(g_r[1]).max()) > 0
  assert float(jnp.abs(g_r[2][3]).max()) == 0.0  # the unused expert learns nothing


def test_router_rules_and_ties_pick_the_lower_expert_index():
  # Row 0: all four equal. Row 1: experts 1 and 2 tie for first, expert 3 is third.
  logits = jnp.asarray([[1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 2.0, 1.0]], jnp.float32)
  e = math.e
  for kind, norm, row0, row1 in [
      ("softmax_topk", False, [0.25, 0.25], [e**2 / (1 + 2 * e**2 + e)] * 2),
      ("softmax_topk", True, [0.5, 0.5], [0.5, 0.5]),
      ("topk_softmax", False, [0.5, 0.5], [0.5, 0.5])]:
    r = moe.route(logits, 2, kind, norm)
    assert r.experts_TxK.tolist() == [[0, 1], [1, 2]], kind
    np.testing.assert_allclose(r.weights_TxK, [row0, row1], rtol=1e-6, err_msg=f"{kind} {norm}")
  # k = 3 on row 1: Qwen's unnormalised probabilities versus Mixtral's softmax over the k.
  r = moe.route(logits[1:], 3, "softmax_topk", False)
  np.testing.assert_allclose(r.weights_TxK, [[e**2, e**2, e]] / np.float32(1 + 2 * e**2 + e),
                             rtol=1e-6)
  r = moe.route(logits[1:], 3, "topk_softmax", False)
  np.testing.assert_allclose(r.weights_TxK, [[e**2, e**2, e]] / np.float32(2 * e**2 + e),
                             rtol=1e-6)
  assert r.experts_TxK.tolist() == [[1, 2, 3]]


def test_moe_model_ragged_equals_dense_and_scanned_layers_stack_the_experts():
  """With Qwen3.5-MoE's gated shared expert beside the experts (a dense path in both)."""
  config = get_preset("tiny", num_experts=4, num_experts_per_tok=2, moe_mlp_dim=24,
                      norm_topk_prob=True, shared_expert_mlp_dim=16, shared_expert_gate=True)
  model = random_model(config)
  assert model.layers[0].mlp.gate[...].shape == (4, 64, 24)
  assert model.layers[1].mlp.shared_expert.output_gate[...].shape == (64, 1)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, size=(2, 9)), jnp.int32)
  ragged = forward(model, tokens).logits_BxLxV
  dense = forward(with_config(model, moe_impl="dense", scan_layers=True), tokens).logits_BxLxV
  np.testing.assert_allclose(ragged, dense, rtol=1e-4, atol=1e-4)
  dense_mlp = forward(random_model(get_preset("tiny")), tokens).logits_BxLxV
  assert dense_mlp.shape == ragged.shape


@pytest.mark.parametrize("field,value,message", [
    ("num_experts_per_tok", 5, "model.num_experts_per_tok=5 must be an integer from 1 to "
                               "model.num_experts=4"),
    ("moe_impl", "megablox", "model.moe_impl='megablox'; choose one of ragged, dense"),
    ("router", "sparsemixer", "model.router='sparsemixer'; choose one of softmax_topk, "
                              "topk_softmax, gemma4, sigmoid"),
    ("num_experts", -1, "model.num_experts=-1 must be a non-negative integer"),
    ("shared_expert_gate", True, "model.shared_expert_gate=True gates a shared expert, but "
                                 "model.shared_expert_mlp_dim=0"),
])
def test_moe_config_errors_name_the_field_and_the_choices(field, value, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
    get_preset("tiny", **{"num_experts": 4, field: value})


def test_router_stats_count_only_real_tokens_and_losses_by_hand():
  # 3 tokens over 2 experts, top-1; the third is padding. Logits (ln 3, 0): p = (3/4, 1/4),
  # logsumexp = ln 4; logits (0, ln 3): p = (1/4, 3/4).
  ln3, ln4 = math.log(3.0), math.log(4.0)
  logits = jnp.asarray([[ln3, 0.0], [ln3, 0.0], [0.0, ln3]], jnp.float32)
  routing = moe.route(logits, 1, "topk_softmax", False)
  stats = moe.router_stats(routing, jnp.asarray([True, True, False]))
  np.testing.assert_allclose(stats.load_E, [2.0, 0.0])
  np.testing.assert_allclose(stats.prob_E, [1.5, 0.5], rtol=1e-6)
  np.testing.assert_allclose(stats.z, 2 * ln4**2, rtol=1e-6)
  assert float(stats.tokens) == 2.0
  # Two layers: this one (all on expert 0) and a balanced one (load 1/1, probs 1/2 each).
  both = jax.tree.map(lambda a, b: jnp.stack([a, b]), stats, moe.RouterStats(
      jnp.asarray([1.0, 1.0]), jnp.asarray([1.0, 1.0]), jnp.asarray(0.0), jnp.asarray(2.0),
      jnp.asarray(0.0)))
  terms = moe.router_losses(both)
  # Switch: E * sum_e f_e P_e = 2 * (1 * 3/4 + 0 * 1/4) = 1.5; balanced: 2 * (2 * 1/2 * 1/2) = 1.
  np.testing.assert_allclose(terms["aux_N"], [1.5, 1.0], rtol=1e-6)
  np.testing.assert_allclose(terms["z_N"], [ln4**2, 0.0], rtol=1e-6)
  np.testing.assert_allclose(terms["max_over_mean_load_N"], [2.0, 1.0], rtol=1e-6)


def test_capacity_drops_the_assignments_past_each_experts_first_slots_in_token_order():
  # 5 tokens, k = 2, E = 5, factor 1: C = ceil(1 * 5 * 2 / 5) = 2 assignments per expert.
  experts = jnp.asarray([[0, 1], [0, 2], [0, 1], [1, 0], [2, 0]], jnp.int32)
  weights = jnp.asarray([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.8, 0.2], [0.9, 0.1]])
  routing = moe.Routing(weights, experts, jnp.zeros((5, 5)))
  mask = jnp.asarray([True, True, False, True, True])
  assert moe.expert_capacity(5, 2, 5, 1.0) == 2 and moe.expert_capacity(5, 2, 5, None) is None

  @jax.jit  # one compile, not one per eager op
  def run(routing, mask):
    full, padded = moe.with_capacity(routing, 2, None), moe.with_capacity(routing, 2, mask)
    stats = moe.router_stats(padded, mask)
    ratios = moe.objective_terms(jax.tree.map(lambda a: a[None], stats), 4.0, 0.0, 0.0)[2]
    return (full, padded, moe.router_stats(full, None).dropped, stats.dropped,
            moe.router_stats(routing, mask).dropped, ratios["expert_tokens_dropped_l0"])

  full, padded, full_dropped, padded_dropped, dropless, ratio = run(routing, mask)
  # All real: expert 0 is chosen by tokens 0..4 and keeps 0, 1; expert 1 by 0, 2, 3 and keeps
  # 0, 2; expert 2 by 1, 4 (both kept). Dropped: (2, e0), (3, e0), (4, e0), (3, e1).
  assert full.keep_TxK.tolist() == [[True, True], [True, True], [False, True], [False, False],
                                    [True, False]]
  np.testing.assert_allclose(full.weights_TxK, [[0.6, 0.4], [0.7, 0.3], [0.0, 0.5], [0.0, 0.0],
                                                [0.9, 0.0]])
  assert float(full_dropped) == 4.0
  # Token 2 is padding: it takes no slot, so expert 1 keeps token 3; expert 0 still drops 3, 4.
  assert padded.keep_TxK.tolist() == [[True, True], [True, True], [False, False], [True, False],
                                      [True, False]]
  assert float(padded_dropped) == 2.0 and float(dropless) == 0.0
  # The metric: dropped over the layer's real assignments (8), next to the load ratio.
  assert [float(v) for v in ratio] == [2.0, 8.0]


def test_ragged_with_capacity_equals_dense_with_capacity_and_skips_the_dropped_rows():
  x, logits, gate, up, down = _arrays(seed=3)
  mask = jnp.asarray([True] * 5 + [False, True])
  cotangent = jnp.asarray(np.random.default_rng(4).normal(size=(T, D)), jnp.float32)
  # ceil(0.5 * 7 * 2 / 5) = 2; expert 3 gets nothing, so 12 real assignments meet 8 slots.
  capacity = moe.expert_capacity(T, K, E, 0.5)
  assert capacity == 2

  def loss(dispatch, *args):
    x, logits, gate, up, down = args
    routing = moe.with_capacity(moe.route(logits, K, "softmax_topk", True), capacity, mask)
    return jnp.sum(dispatch(x, routing, gate, up, down, jax.nn.silu) * cotangent), routing

  out = {}
  for name, dispatch in (("ragged", moe.ragged_experts), ("dense", moe.dense_experts)):
    fn = jax.value_and_grad(lambda *a, d=dispatch: loss(d, *a), argnums=(0, 1, 2, 3, 4),
                            has_aux=True)
    out[name] = jax.jit(fn)(x, logits, gate, up, down)
  ((v_r, routing), g_r), ((v_d, _), g_d) = out["ragged"], out["dense"]
  np.testing.assert_allclose(v_r, v_d, rtol=1e-5, atol=1e-5)
  for a, b, name in zip(g_r, g_d, ("x", "logits", "gate", "up", "down")):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
  keep = np.asarray(routing.keep_TxK)
  assert int(np.sum(~keep[np.asarray(mask)])) >= 4 and not keep[5].any()
  # A token that lost nothing gets its dropless output; one that lost an expert does not.
  dropless, with_cap = jax.jit(lambda routing: [moe.ragged_experts(
      x, r, gate, up, down, jax.nn.silu) for r in (
          moe.route(logits, K, "softmax_topk", True), routing)])(routing)
  whole = keep.all(axis=1)
  np.testing.assert_allclose(with_cap[whole], dropless[whole], rtol=1e-5, atol=1e-6)
  assert not np.allclose(with_cap[~whole], dropless[~whole])
