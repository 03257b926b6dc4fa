"""The shared mixture-of-experts base of DeepSeek V3, GLM-4.5, Llama 4 and Qwen3-MoE with dense
layers: the sigmoid router (choice bias, expert groups, renormalisation, scaling) against a
token-by-token numpy reading of DeepSeek's rule, Llama 4's input-scaled top-1 expert against
numpy, and models whose layers mix dense MLPs and experts (`moe_layers`): their parameters,
ragged against the dense dispatch, their router statistics, blocks of them, their FLOPs by hand,
and the config checks' one-line refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.errors import ConfigError
from distillax.framework import flops
from distillax.models.moe.routing import SigmoidGroups, route
from distillax.models.presets import get_preset
from distillax.models.transformer import with_config
from tests.support.models import Normal, forward, random_model

T, E, K = 9, 8, 3


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _deepseek_by_hand(logits, bias, groups, kept, k, norm, scale):
  """DeepSeek V3's router, one token at a time: choose by score + bias within the `kept` groups
  whose two best choices sum highest, weigh by the plain scores."""
  experts, weights = [], []
  for row in logits:
    score = _sigmoid(row)
    choice = score + bias
    size = len(row) // groups
    group_score = [sum(sorted(choice[g * size:(g + 1) * size])[-2:]) for g in range(groups)]
    open_groups = sorted(range(groups), key=lambda g: -group_score[g])[:kept]
    allowed = [e for e in range(len(row)) if e // size in open_groups]
    chosen = sorted(allowed, key=lambda e: -choice[e])[:k]
    w = score[chosen]
    if norm:
      w = w / w.sum()
    experts.append(chosen)
    weights.append(w * scale)
  return np.asarray(experts), np.asarray(weights)


@pytest.mark.parametrize("groups,kept,norm,scale", [(4, 2, True, 2.5), (1, 1, False, 1.0),
                                                    (2, 1, True, 1.0)])
def test_sigmoid_router_matches_deepseeks_rule_token_by_token(groups, kept, norm, scale):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(T, E)).astype(np.float32)
  bias = (rng.normal(size=E) * 0.5).astype(np.float32)
  routing = route(jnp.asarray(logits), K, "sigmoid", norm, scale=scale,
                  sigmoid=SigmoidGroups(jnp.asarray(bias), groups, kept))
  experts, weights = _deepseek_by_hand(logits, bias, groups, kept, K, norm, scale)
  got = np.asarray(routing.experts_TxK)
  for t in range(T):  # the same experts with the same weights (order: best choice first)
    np.testing.assert_array_equal(got[t], experts[t])
    np.testing.assert_allclose(np.asarray(routing.weights_TxK)[t], weights[t], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(routing.probs_TxE).sum(-1), 1.0, rtol=1e-6)


def test_the_choice_bias_and_the_groups_change_which_experts_not_their_scores():
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(size=(T, E)), jnp.float32)
  plain = route(logits, K, "sigmoid", False)
  bias = jnp.zeros((E,), jnp.float32).at[7].set(10.0)  # expert 7 always chosen ...
  biased = route(logits, K, "sigmoid", False, sigmoid=SigmoidGroups(bias))
  assert bool(jnp.all(jnp.any(biased.experts_TxK == 7, axis=1)))
  # ... and weighted by its own score, not by score + bias
  np.testing.assert_allclose(jnp.take_along_axis(jax.nn.sigmoid(logits), biased.experts_TxK, 1),
                             biased.weights_TxK, rtol=1e-6)
  # 4 groups of 2 experts, 1 kept: each token's 2 experts are the two of one group
  grouped = route(logits, 2, "sigmoid", False, sigmoid=SigmoidGroups(None, 4, 1))
  pairs = np.asarray(grouped.experts_TxK) // 2
  np.testing.assert_array_equal(pairs[:, 0], pairs[:, 1])
  free = np.asarray(route(logits, 2, "sigmoid", False).experts_TxK) // 2
  assert (free[:, 0] != free[:, 1]).any()  # without groups some tokens span two


def test_llama4_top1_runs_the_chosen_expert_on_its_input_times_the_sigmoid_weight():
  config = get_preset("tiny", num_layers=1, embed_dim=8, num_experts=4, num_experts_per_tok=1,
                      moe_mlp_dim=6, router="sigmoid", moe_scale_inputs=True,
                      shared_expert_mlp_dim=5)
  layer = random_model(config, seed=1, init=Normal(1.0)).layers[0].mlp
  x = np.random.default_rng(1).normal(size=(1, 5, 8)).astype(np.float32)
  got = nnx.jit(lambda m, x: m(x)[0])(layer, jnp.asarray(x))
  silu = lambda v: v * _sigmoid(v)
  p = {k: np.asarray(getattr(layer, k)[...]) for k in ("router", "gate", "up", "down")}
  sh = {k: np.asarray(getattr(layer.shared_expert, k)[...]) for k in ("gate", "up", "down")}
  want = []
  for token in x[0]:
    logits = token @ p["router"]
    e = int(np.argmax(logits))
    scaled = token * _sigmoid(logits[e])
    routed = (silu(scaled @ p["gate"][e]) * (scaled @ p["up"][e])) @ p["down"][e]
    want.append(routed + (silu(token @ sh["gate"]) * (token @ sh["up"])) @ sh["down"])
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want), rtol=1e-4, atol=1e-4)


MIXED = get_preset("tiny", num_layers=4, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=24,
                   moe_layers=(3, 1), router="sigmoid", router_score_bias=True, router_groups=2,
                   router_groups_kept=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                   shared_expert_mlp_dim=16)


def test_a_model_of_dense_and_moe_layers_runs_each_and_routes_dense_equal_to_ragged():
  assert MIXED.moe_layers == (1, 3)  # one form: sorted
  model = random_model(MIXED)
  kinds = [type(block.mlp).__name__ for block in model.layers]
  assert kinds == ["MLP", "MoE", "MLP", "MoE"]
  assert model.layers[0].mlp.gate[...].shape == (64, 128)  # the dense width, mlp_dim
  assert model.layers[1].mlp.router_score_bias[...].shape == (4,)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, size=(2, 9)), jnp.int32)
  out = forward(model, tokens)
  assert out.router_stats.load_E.shape == (2, 4)  # the two layers with experts
  np.testing.assert_allclose(out.router_stats.load_E.sum(-1), 2 * 9 * 2)
  dense = forward(with_config(model, moe_impl="dense"), tokens).logits_BxLxV
  np.testing.assert_allclose(out.logits_BxLxV, dense, rtol=1e-4, atol=1e-4)
  blocks = MIXED.select_layers((2, 3, 0))
  assert blocks.moe_layers == (1,) and blocks.num_experts == 4
  assert MIXED.select_layers((3, 1)).moe_layers is None  # every block has experts


def test_flops_count_dense_layers_at_their_width_and_the_shared_expert():
  got = flops.forward_flops_breakdown(MIXED, batch=1, seq_len=3)
  D, tokens = 64, 3
  per_moe = 3 * (2 * 24 + 16) + 4  # 2 routed experts + the shared one (gate, up, down), router
  assert got["mlp"] == 2.0 * tokens * D * (2 * per_moe + 2 * 3 * 128)


@pytest.mark.parametrize("change,message", [
    (dict(moe_layers=(0, 4)), "model.moe_layers=(0, 4) must list layer indices from 0 to 3"),
    (dict(moe_layers=()), "model.moe_layers=() leaves no layer with experts"),
    (dict(scan_layers=True), "model.scan_layers=True cannot stack dense and MoE layers"),
    (dict(router="softmax_topk"), "model.router_score_bias is part of the sigmoid router"),
    (dict(router_groups=3), "model.router_groups=3, router_groups_kept=1: the num_experts=4 "
                            "experts must split into groups of at least 2"),
    (dict(num_experts_per_tok=3), "model.num_experts_per_tok=3 is more than the 1 kept groups "
                                  "of 2 experts hold"),
    (dict(routed_scaling_factor=0.0), "model.routed_scaling_factor=0.0 must be a positive"),
    (dict(moe_scale_inputs=True), "model.moe_scale_inputs=True (Llama 4) scales the one chosen "
                                  "expert's input by its weight, but model.num_experts_per_tok=2"),
    (dict(num_experts=0, router_score_bias=False, router_groups=1, shared_expert_mlp_dim=0),
     "model.moe_layers=[1, 3] names layers with experts, but model.num_experts=0"),
])
def test_moe_base_config_errors_are_one_line(change, message):
  with pytest.raises(ConfigError) as raised:
    MIXED.replace(**change)
  assert message in str(raised.value) and "\n" not in str(raised.value)
