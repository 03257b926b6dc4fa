"""Fake quantization: rounding against a numpy reference, the forward against the numpy
transformer, error ordering, the straight-through gradient, activation rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.errors import ConfigError
from distillax.quant import (QuantConfig, QuantRule, WeightQuant, find_matmul_sites,
                             quantize_for_training, quantize_post_training)
from distillax.quant.fakequant import fake_quantize_weight
from tests.models import reference
from tests.quant.helpers import np_fake_quant, tokens
from tests.support.models import FAN_IN, TINY, TINY1, logits, numpy_params, random_model

WEIGHT_CASES = [("int8", None), ("int4", None), ("int4", 8), ("nf4", 8), ("float8_e4m3fn", None)]


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model():
  return random_model(TINY1, seed=0, init=FAN_IN)


@pytest.mark.parametrize("qtype,tile", WEIGHT_CASES)
def test_weight_rounding_matches_numpy(qtype, tile):
  # An 'o'-like weight (heads, head_dim, embed) contracted over its first two axes.
  w = np.random.default_rng(1).normal(size=(4, 16, 24)).astype(np.float32)
  wq = WeightQuant(qtype, contract_axes=(0, 1), ndim=3, tile_size=tile)
  got = np.asarray(jax.jit(fake_quantize_weight, static_argnums=1)(jnp.asarray(w), wq))
  want = np_fake_quant(w, qtype, reduce_axes=(0, 1), tile=tile, tile_axis=1)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  levels = len(np.unique(got[:, :tile or 16, 0]))  # values sharing one scale
  assert levels <= {"int8": 256, "int4": 16, "nf4": 16, "float8_e4m3fn": 256}[qtype]


def test_sites_follow_the_model_einsums(model):
  sites = {s.name: s for s in find_matmul_sites(model)}
  assert set(sites) == {f"layers/0/{m}/{w}" for m, ws in (("attn", "qkvo"),
                                                           ("mlp", ("gate", "up", "down")))
                        for w in ws} | {"lm_head"}
  assert sites["layers/0/attn/o"].contract_axes == (0, 1)  # 'BLHK,HKD->BLD'
  assert sites["layers/0/attn/q"].contract_axes == (0,)  # 'BLD,DHK->BLHK'
  assert sites["layers/0/mlp/down"].module_path == "layers/0/mlp"
  qat = quantize_for_training(model, QuantConfig.simple("int4", "int8"))
  assert {s.name: s for s in find_matmul_sites(qat)} == sites
  scanned_model = random_model(TINY.replace(scan_layers=True), init=FAN_IN)
  scanned = {s.name: s for s in find_matmul_sites(scanned_model)}
  assert scanned["layers/attn/o"].stacked == 1 and scanned["layers/attn/o"].shape == (8, 8, 64)
  assert sites["lm_head"].module_path == ""


def test_ptq_forward_matches_numpy_transformer(model):
  """Weight-only int4 (tiled) PTQ logits equal the float64 numpy decoder run on weights rounded
  by the numpy quantizer: right weights, right axes, nothing else rounded."""
  qcfg = QuantConfig((QuantRule(".*", "int4", None, 8),))
  toks = tokens(1, 10, TINY1.vocab_size)
  got = np.asarray(logits(quantize_post_training(model, qcfg), toks))[0]
  layers, embedding, final_norm, lm_head = numpy_params(model)
  for p in layers:
    for name in ("q", "k", "v"):
      p["attn"][name] = np_fake_quant(p["attn"][name], "int4", (0,), 8, 0)
    p["attn"]["o"] = np_fake_quant(p["attn"]["o"], "int4", (0, 1), 8, 1)
    for name in ("gate", "up", "down"):
      p["mlp"][name] = np_fake_quant(p["mlp"][name], "int4", (0,), 8, 0)
  lm_head = np_fake_quant(lm_head, "int4", (0,), 8, 0)
  want = reference.forward(TINY1, layers, embedding, final_norm, lm_head, np.asarray(toks[0]))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_error_shrinks_from_int4_to_int8(model):
  toks = tokens(2, 16, TINY1.vocab_size)
  fp = np.asarray(logits(model, toks))
  err = {}
  for name, rule in {"int4": ("int4", None), "int8": ("int8", None),
                     "int4+act8": ("int4", "int8"), "int8+act8": ("int8", "int8")}.items():
    qat = quantize_for_training(model, QuantConfig.simple(*rule))
    err[name] = float(np.mean(np.abs(np.asarray(logits(qat, toks)) - fp)))
  assert 0 < err["int8"] < err["int4"] / 8, err  # 16x finer grid
  assert err["int8"] < err["int8+act8"] < err["int4"], err
  assert err["int4+act8"] > err["int4"] * 0.9, err


def _loss(m, toks):
  logp = jax.nn.log_softmax(m(toks[:, :-1]).logits_BxLxV, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1))


def _grads(m, toks):
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)
  fn = lambda p: _loss(nnx.merge(graphdef, p, rest), toks)
  return nnx.to_pure_dict(jax.jit(jax.grad(fn))(params))


def test_straight_through_gradient(model):
  """The QAT gradient w.r.t. the full-precision weights is the fp model's gradient at the
  rounded weights (identity through the rounding): non-zero and finite everywhere."""
  qcfg = QuantConfig.simple("int4", None, 8)
  toks = tokens(2, 12, TINY1.vocab_size, seed=3)
  g_qat = _grads(quantize_for_training(model, qcfg), toks)
  g_ref = _grads(quantize_post_training(model, qcfg), toks)
  for a, b in zip(jax.tree.leaves(g_qat), jax.tree.leaves(g_ref)):
    assert np.all(np.isfinite(a)) and np.any(a != 0)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  g_act = _grads(quantize_for_training(model, QuantConfig.simple("int4", "int8")), toks)
  assert all(np.all(np.isfinite(g)) and np.any(g != 0) for g in jax.tree.leaves(g_act))


class _Projection(nnx.Module):
  def __init__(self):
    w = np.random.default_rng(2).normal(size=(8, 6)).astype(np.float32)
    self.w = nnx.Param(jnp.asarray(w), logical_axes=("embed", "mlp"))

  def __call__(self, x_BxLxD):
    return jnp.einsum("BLD,DF->BLF", x_BxLxD, self.w[...])


@pytest.mark.parametrize("tile", [None, 4])
def test_activation_rounding_matches_numpy(tile):
  """int8 weights and int8 inputs: one input scale per token (per tile of D when tiled)."""
  x = np.random.default_rng(4).normal(size=(2, 3, 8)).astype(np.float32)
  proj = _Projection()
  qat = quantize_for_training(proj, QuantConfig.simple("int8", "int8", tile),
                              sample_tokens=jnp.asarray(x))
  graphdef, state = nnx.split(qat)
  got = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(x))
  xq = np_fake_quant(x, "int8", (2,), tile, 2)
  wq = np_fake_quant(np.asarray(proj.w[...]), "int8", (0,), tile, 0)
  np.testing.assert_allclose(np.asarray(got), np.einsum("bld,df->blf", xq, wq), rtol=1e-5,
                             atol=1e-5)


def test_chunked_logits_round_their_input_too(model):
  """`logits_from_hidden` (used by chunked losses outside __call__) runs under the interceptor."""
  ptq = quantize_post_training(model, QuantConfig.simple("int8", "int8"))
  graphdef, state = nnx.split(ptq)

  def both(s, t):
    m = nnx.merge(graphdef, s)
    out = m(t)
    return out.logits_BxLxV, m.logits_from_hidden(out.final_hidden_BxLxD)

  full, chunked = jax.jit(both)(state, tokens(2, 8, TINY1.vocab_size))
  np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), rtol=1e-6, atol=1e-6)


def test_config_errors(model):
  with pytest.raises(ConfigError, match="weight_qtype"):
    QuantRule(".*", "int3")
  with pytest.raises(ConfigError, match="act_qtype"):
    QuantRule(".*", "int8", "nf4")
  with pytest.raises(ConfigError, match="matches no module"):
    quantize_for_training(model, QuantConfig.simple("int8", module_path="layers/9/.*"))
  with pytest.raises(ConfigError, match="does not divide"):
    quantize_for_training(model, QuantConfig.simple("int4", tile_size=48))
  cfg = QuantConfig.from_config({"rules": [("", None), ("layers/.*", "int4", "int8", 16)],
                                 "start_step": 5})
  assert cfg.rule_for("").weight_qtype is None and cfg.rule_for("layers/0/mlp").tile_size == 16
