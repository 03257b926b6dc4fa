"""LoRA / QLoRA: only adapters train (through the real engine, fsdp on 8 devices), QLoRA bases
stay bit-identical, adapters shard like their weights, merge and adapter files round-trip."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import partitioning as pt
from distillax.errors import ConfigError, UserError
from distillax.framework.engine import build_engine
from distillax.quant import (LoRAParam, LoRAWeight, QuantConfig, apply_lora, load_adapters,
                             lora_dropout, merge_lora, quantize_post_training, save_adapters,
                             with_lora_dropout)
from distillax.quant.weights import QuantizedValue
from distillax.trainers import lm_objective
from tests.framework.engine_fixtures import optimizer_config, packed_batches
from tests.quant.helpers import TINY1, logits, numpy_model, tokens

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(jax.device_get(x))
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _train(model, steps=2):
  """`steps` engine steps (jit, fsdp 4x2) training only LoRAParams, with adapter dropout."""
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rules = pt.rules_from_config({"strategy": "fsdp"})
  batches = packed_batches(steps, batch=8, seq_len=16, vocab=TINY1.vocab_size, seed=5)
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batches[0].items()}
  engine = build_engine(model, {}, with_lora_dropout(lm_objective), optimizer_config(), 4, mesh,
                        rules, "jit", shapes, trainable=LoRAParam)
  state = engine.init_state(model, {}, seed=0)
  before = jax.device_get(state)
  for batch in batches:
    state, metrics = engine.runner(state, engine.runner.place_batch(batch))
    assert np.isfinite(float(metrics["loss"]))
  return engine, before, jax.device_get(state)


@pytest.fixture
def mesh_model():  # fresh per test: the engine donates the state, base weights included
  mesh = pt.create_mesh({"data": 4, "model": 2})
  return numpy_model(TINY1, seed=0, mesh=mesh, strategy="fsdp")


def test_lora_trains_only_adapters_which_shard_like_their_weights(mesh_model):
  lora = apply_lora(mesh_model, module_regex=r"layers/.*/attn/(q|o)|lm_head", rank=4)
  engine, before, after = _train(lora)
  trainable = _flat(after.params)
  assert trainable and all(k.endswith(("['lora_a']", "['lora_b']")) for k in trainable)
  assert len(trainable) == 2 * 3  # q and o of the layer, lm_head
  # Frozen part (base weights, norms, embeddings) bit-identical; adapters moved.
  for k, v in _flat(before.frozen).items():
    np.testing.assert_array_equal(v, _flat(after.frozen)[k], err_msg=k)
  moved = [not np.array_equal(v, trainable[k]) for k, v in _flat(before.params).items()]
  assert all(moved)
  # Optimizer state exists for the adapters only (Adam: two moments of each).
  adapter_size = sum(v.size for v in trainable.values())
  opt_size = sum(x.size for x in jax.tree.leaves(after.opt_state) if np.ndim(x) > 0)
  assert opt_size == 2 * adapter_size
  # A spans the contracted dims, B the output dims: each inherits that dim's placement.
  sh = engine.layout.shardings.params["layers"][0]["attn"]
  weight_spec = lambda name: tuple(getattr(mesh_model.layers[0].attn, name).get_raw_value()
                                   .sharding.spec) + (None,) * 3
  assert tuple(sh["q"]["lora_a"].spec)[:1] == weight_spec("q")[:1]  # (embed | rank)
  assert tuple(sh["o"]["lora_a"].spec)[:2] == weight_spec("o")[:2]  # (heads, head_dim | rank)
  assert tuple(sh["o"]["lora_b"].spec)[1:2] == weight_spec("o")[2:3]  # (rank | embed)
  assert any(a is not None for s in jax.tree.leaves(
      engine.layout.shardings.params, is_leaf=lambda x: hasattr(x, "spec")) for a in s.spec)


def test_qlora_base_stays_bit_identical(mesh_model):
  qlora = apply_lora(mesh_model, module_regex=r"layers/.*", rank=4, base_qtype="nf4",
                     base_tile_size=8)
  # Before training the QLoRA model is the nf4 model (B = 0), computed independently by PTQ.
  toks = tokens(2, 8, TINY1.vocab_size)
  ptq = quantize_post_training(mesh_model, QuantConfig.simple("nf4", None, 8,
                                                              module_path="layers/.*"))
  np.testing.assert_allclose(logits(qlora, toks), logits(ptq, toks), rtol=1e-5, atol=1e-5)
  codes = [v for _, v in nnx.iter_graph(qlora) if isinstance(v, QuantizedValue)]
  assert len(codes) == 2 * 7 and {str(v.get_raw_value().dtype) for v in codes} >= {"uint8"}
  q_base = qlora.layers[0].attn.q.base  # nf4 codes two per byte: half the bytes of int8
  assert q_base.qvalue.get_raw_value().shape == (64, 8, 4) and q_base.shape == (64, 8, 8)
  _, before, after = _train(qlora)
  frozen_before, frozen_after = _flat(before.frozen), _flat(after.frozen)
  base_keys = [k for k in frozen_before if "['base']" in k]
  assert len(base_keys) == 2 * 7  # qvalue + scale of the layer's 7 weights
  for k in frozen_before:
    np.testing.assert_array_equal(frozen_before[k], frozen_after[k], err_msg=k)
  assert all(not np.array_equal(v, _flat(after.params)[k])
             for k, v in _flat(before.params).items() if k.endswith("['lora_b']"))


def _randomize_b(model, scale=0.05):
  for i, (path, var) in enumerate(nnx.iter_graph(model)):
    if isinstance(var, LoRAParam) and path[-1] == "lora_b":
      var.set_value(jnp.asarray(np.random.default_rng(i).normal(size=var.shape) * scale,
                                var.get_raw_value().dtype))


def test_merge_dropout_and_adapter_files(tmp_path):
  model = numpy_model(TINY1, seed=1)
  lora = apply_lora(model, module_regex=r".*attn/(q|o)", rank=4, alpha=8.0, dropout=0.2)
  _randomize_b(lora)
  toks = tokens(2, 10, TINY1.vocab_size, seed=2)

  # Merged weights are W + alpha/rank * A @ B (numpy), and the merged model computes the same
  # logits as the adapted one (activation-space adapters, dropout off).
  merged = merge_lora(lora)
  assert type(merged).__name__ == "Transformer" and not any(
      isinstance(n, LoRAWeight) for _, n in nnx.iter_graph(merged))
  wrapper = lora.layers[0].attn.o
  a, b = np.asarray(wrapper.lora_a[...]), np.asarray(wrapper.lora_b[...])
  want_o = np.asarray(model.layers[0].attn.o[...]) + 2.0 * np.einsum("hkr,rd->hkd", a, b)
  np.testing.assert_allclose(np.asarray(merged.layers[0].attn.o[...]), want_o, rtol=1e-5,
                             atol=1e-6)
  base_logits = logits(model, toks)
  lora_logits = logits(lora, toks)
  np.testing.assert_allclose(lora_logits, logits(merged, toks), rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(lora_logits - base_logits))) > 1e-3

  # Dropout: on only with a key, deterministic per key.
  graphdef, state = nnx.split(lora)

  def with_key(s, t, key):
    with lora_dropout(key):
      return nnx.merge(graphdef, s)(t).logits_BxLxV

  run = jax.jit(with_key)
  d1, d1b, d2 = (run(state, toks, jax.random.key(k)) for k in (1, 1, 2))
  np.testing.assert_array_equal(d1, d1b)
  assert float(jnp.max(jnp.abs(d1 - d2))) > 1e-4
  assert float(jnp.max(jnp.abs(d1 - lora_logits))) > 1e-4

  # Adapter file: small, exact round trip, refuses a mismatched model.
  path = os.path.join(tmp_path, "adapters.safetensors")
  save_adapters(lora, path)
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
  assert os.path.getsize(path) < model_bytes / 10
  fresh = apply_lora(model, module_regex=r".*attn/(q|o)", rank=4, alpha=8.0, dropout=0.2)
  np.testing.assert_array_equal(logits(load_adapters(fresh, path), toks), lora_logits)
  other = apply_lora(model, module_regex=r".*attn/(q|o)", rank=2, alpha=8.0, dropout=0.2)
  with pytest.raises(UserError, match="apply_lora with the same"):
    load_adapters(other, path)
  with pytest.raises(ConfigError, match="matches no matmul weight"):
    apply_lora(model, module_regex="layers/.*/attention/q")
