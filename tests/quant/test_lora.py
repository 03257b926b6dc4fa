"""LoRA / QLoRA: only adapters train (through the real engine, fsdp on 8 devices), QLoRA bases
stay bit-identical, adapters shard like their weights, merge and adapter files round-trip; the
adapted matmul computes the LoRA formula and its gradients (one matmul or two, by sharding),
dropout masks are Bernoulli draws, and adapters need less scratch than full fine-tuning."""

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import partitioning as pt
from distillax.errors import ConfigError, UserError
from distillax.quant import (LoRAParam, LoRAWeight, QuantConfig, apply_lora, load_adapters,
                             lora_dropout, merge_lora, quantize_post_training, save_adapters,
                             with_lora_dropout)
from distillax.quant import lora_matmul
from distillax.quant.keep_mask import keep_mask_bits, unpack_keep_mask
from distillax.quant.weights import QuantizedValue
from distillax.trainers import lm_objective
from tests.quant.helpers import tokens
from tests.support.engines import mesh_and_rules, packed_batches, run_steps, tiny_engine
from tests.support.models import FAN_IN, TINY, TINY1, logits, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(jax.device_get(x))
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _train(model, steps=2):
  """`steps` engine steps (jit, fsdp 4x2) training only LoRAParams, with adapter dropout."""
  mesh, rules = mesh_and_rules("fsdp", 4, 2)
  batches = packed_batches(steps, batch=8, seq_len=16, vocab=TINY1.vocab_size, seed=5)
  engine = tiny_engine(model, batches[0], mesh, rules, steps=4,
                       objective=with_lora_dropout(lm_objective), trainable=LoRAParam)
  state = engine.init_state(model, {}, seed=0)
  before = jax.device_get(state)
  state, losses = run_steps(engine, state, batches)
  assert np.all(np.isfinite(losses))
  return engine, before, jax.device_get(state)


@pytest.fixture
def mesh_model():  # fresh per test: the engine donates the state, base weights included
  mesh = pt.create_mesh({"data": 4, "model": 2})
  return random_model(TINY1, seed=0, init=FAN_IN, mesh=mesh, strategy="fsdp")


def test_lora_trains_only_adapters_which_shard_like_their_weights(mesh_model):
  lora = apply_lora(mesh_model, module_regex=r"layers/.*/attn/(q|o)|lm_head", rank=4,
                    dropout=0.1)
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
  # The output layer too: the loss engine differentiates the float leaves it reads, the nf4
  # base's scales among them, which stay frozen.
  qlora = apply_lora(mesh_model, module_regex=r"layers/.*|lm_head", rank=4, base_qtype="nf4",
                     base_tile_size=8, dropout=0.1)
  # Before training the QLoRA model is the nf4 model (B = 0), computed independently by PTQ
  # (lm_head's module path is the root's, "").
  toks = tokens(2, 8, TINY1.vocab_size)
  ptq = quantize_post_training(mesh_model, QuantConfig.simple("nf4", None, 8,
                                                              module_path="layers/.*|"))
  np.testing.assert_allclose(logits(qlora, toks), logits(ptq, toks), rtol=1e-5, atol=1e-5)
  codes = [v for _, v in nnx.iter_graph(qlora) if isinstance(v, QuantizedValue)]
  assert len(codes) == 2 * 8 and {str(v.get_raw_value().dtype) for v in codes} >= {"uint8"}
  q_base = qlora.layers[0].attn.q.base  # nf4 codes two per byte: half the bytes of int8
  assert q_base.qvalue.get_raw_value().shape == (64, 8, 4) and q_base.shape == (64, 8, 8)
  _, before, after = _train(qlora)
  frozen_before, frozen_after = _flat(before.frozen), _flat(after.frozen)
  base_keys = [k for k in frozen_before if "['base']" in k]
  assert len(base_keys) == 2 * 8  # qvalue + scale of the layer's 7 weights and lm_head
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
  model = random_model(TINY1, seed=1, init=FAN_IN)
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


# ---- the adapted matmul: formula, gradients, dropout masks, memory ---------------------------

def _keep_mask(wrapper, key, shape):
  """The keep mask a site draws for an input of `shape` under the step key `key`."""
  site_key = jax.random.fold_in(key, zlib.crc32(wrapper.site_name.encode()) & 0x7FFFFFFF)
  bits = keep_mask_bits(site_key, shape, 1.0 - wrapper.dropout)
  return unpack_keep_mask(bits, shape[-1])


def _site_and_reference(wrapper, spec, key, trainable):
  """(the site's matmul, the formula x @ W + scaling * (dropout(x) @ A) @ B written out with
  jnp) as functions of (x, the `trainable` variables), and those variables."""
  graphdef, params, rest = nnx.split(wrapper, trainable, ...)
  x_spec, w_spec = spec.split("->")[0].split(",")
  contract = "".join(c for c in w_spec if c in x_spec)
  h_spec = f"{x_spec},{contract}r->{''.join(c for c in x_spec if c not in contract)}r"
  delta_spec = f"{h_spec.split('->')[1]},r{''.join(c for c in w_spec if c not in x_spec)}->"
  delta_spec += spec.split("->")[1]

  def site(x, p):
    w = nnx.merge(graphdef, p, rest)
    with lora_dropout(key):
      return w.intercepted_einsum(spec, (x, w.base_value()), 1, {})

  def reference(x, p):
    w = nnx.merge(graphdef, p, rest)
    xd = x
    if key is not None and w.dropout > 0:
      xd = jnp.where(_keep_mask(w, key, x.shape), x / (1.0 - w.dropout), 0.0)
    h = jnp.einsum(h_spec, xd, w.lora_a[...])
    return jnp.einsum(spec, x, w.base_value()) + w.scaling * jnp.einsum(delta_spec, h,
                                                                        w.lora_b[...])
  return site, reference, params


@pytest.mark.parametrize("site_name,base_qtype,dropout,trains_base,backward", [
    ("o", None, 0.25, False, "merged"),  # two contracted dims (heads, head_dim)
    ("o", None, 0.0, False, "merged"),  # the same, dx through W + s A B (no dropout)
    ("down", "nf4", 0.25, False, "merged"),  # QLoRA base, dequantized in both passes
    ("down", "nf4", 0.0, False, "merged"),  # dx through the dequantized W + s A B
    ("down", "nf4", 0.0, False, "apart"),  # dx through the base and the adapter apart
    ("down", "nf4", 0.0, False, "by_platform"),  # the merged form on a TPU: apart here
    ("q", None, 0.0, True, "merged"),  # no dropout; the base trains too (trainable=nnx.Param)
    ("lm_head", None, 0.25, False, "merged"),  # the model's '...D,DV->...V': an ellipsis on x
    ("lm_head", None, 0.0, False, "merged"),
])
def test_adapted_matmul_is_the_lora_formula_with_its_gradients(site_name, base_qtype, dropout,
                                                                trains_base, backward,
                                                                monkeypatch):
  monkeypatch.setattr(lora_matmul, "BACKWARD_MERGED", backward != "apart")
  # These few tokens would not pay for merging (merge_pays), nor would a CPU (MERGED_ON_CPU):
  # the merged form is taken anyway ("merged"), or chosen by the platform ("by_platform").
  monkeypatch.setattr(lora_matmul.AdaptedMatmul, "merge_pays", lambda self, x, b: True)
  monkeypatch.setattr(lora_matmul, "MERGED_ON_CPU", backward == "merged")
  model = random_model(TINY1, seed=4, init=FAN_IN)
  lora = apply_lora(model, module_regex=r".*/(q|o|down)|lm_head", rank=4, alpha=8.0,
                    dropout=dropout,
                    base_qtype=base_qtype, base_tile_size=8 if base_qtype else None)
  _randomize_b(lora)
  block = lora.layers[0]
  wrapper, spec = {"o": (block.attn.o, "BLHK,HKD->BLD"), "q": (block.attn.q, "BLD,DHK->BLHK"),
                   "down": (block.mlp.down, "BLF,FD->BLD"),
                   "lm_head": (lora.lm_head, "...D,DV->...V")}[site_name]
  site, reference, params = _site_and_reference(wrapper, spec, jax.random.key(11),
                                                nnx.Param if trains_base else LoRAParam)
  x_shape = {"o": (2, 6, 8, 8), "q": (2, 6, 64), "down": (2, 6, 128),
             "lm_head": (2, 6, 64)}[site_name]
  x = jnp.asarray(np.random.default_rng(5).normal(size=x_shape), jnp.float32)
  y, site_vjp = jax.vjp(jax.jit(site), x, params)
  y_ref, ref_vjp = jax.vjp(reference, x, params)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  g = jnp.asarray(np.random.default_rng(6).normal(size=y.shape), jnp.float32)
  grads, grads_ref = site_vjp(g), ref_vjp(g)
  np.testing.assert_allclose(grads[0], grads_ref[0], rtol=1e-5, atol=1e-5)  # dx
  flat, flat_ref = _flat(grads[1]), _flat(grads_ref[1])
  assert set(flat) == set(flat_ref) and len(flat) == (3 if trains_base else 2)
  for k in flat:
    assert np.abs(flat_ref[k]).max() > 0, k
    np.testing.assert_allclose(flat[k], flat_ref[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_the_merged_weight_is_taken_where_a_device_holds_as_many_tokens_as_outputs():
  """W + s A B costs rank x W's size, the adapter's dx path rank x tokens x W's inputs."""
  m = lora_matmul.for_einsum("BLD", "DF", "BLF", "D", 3, base=None, layout=(True, None),
                             scaling=2.0, keep=1.0, kwargs=())
  lora_b = jnp.zeros((8, 96))
  assert m.merge_pays(jnp.zeros((2, 48, 32)), lora_b)  # 96 tokens, 96 outputs
  assert not m.merge_pays(jnp.zeros((2, 47, 32)), lora_b)
  mesh = pt.create_mesh({"data": 4, "model": 2})
  with pt.use_rules(mesh, pt.rules_from_config({"strategy": "fsdp"})):
    assert not m.merge_pays(jnp.zeros((2, 48, 32)), lora_b)  # 12 tokens a device at most
    assert m.merge_pays(jnp.zeros((8, 96, 32)), lora_b)


def test_row_parallel_sites_keep_two_matmuls_under_tensor_parallelism():
  """Under tp the o and down inputs are split along what they contract: concatenating the
  adapter there would make GSPMD gather them, so those sites add the adapter to x @ W; the
  column-parallel ones (contracting the whole embed dim) take the one-matmul form, laid out
  like their output."""
  mesh = pt.create_mesh({"data": 4, "model": 2})
  lora = apply_lora(random_model(TINY1, seed=0, init=FAN_IN),
                    module_regex=r"layers/.*/(attn|mlp)/.*")
  block = lora.layers[0]
  with pt.use_rules(mesh, pt.rules_from_config({"strategy": "tp"})):
    assert block.attn.o._matmul_layout(8) == (False, None)
    assert block.mlp.down._matmul_layout(8) == (False, None)
    assert block.attn.q._matmul_layout(8) == (True, (None, "model", None))
    assert block.mlp.up._matmul_layout(8) == (True, (None, "model"))
  with pt.use_rules(mesh, pt.rules_from_config({"strategy": "fsdp"})):
    # Weights are split over data by embed, activations by batch: the matmul wants W whole.
    assert block.attn.o._matmul_layout(8) == (True, (None, None, None))
  # The two-matmul form computes the same (values and gradients) as the formula.
  site, reference, params = _site_and_reference(block.attn.o, "BLHK,HKD->BLD",
                                                jax.random.key(2), LoRAParam)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 4, 8, 8)), jnp.float32)
  with pt.use_rules(mesh, pt.rules_from_config({"strategy": "tp"})):
    y, site_vjp = jax.vjp(jax.jit(site), x, params)
  y_ref, ref_vjp = jax.vjp(reference, x, params)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(site_vjp(y)), jax.tree.leaves(ref_vjp(y))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_adapter_dropout_masks_are_bernoulli_draws_of_their_key():
  key = jax.random.key(3)
  bits = keep_mask_bits(key, (64, 16, 512), 0.9)
  assert bits.dtype == jnp.uint8 and bits.shape == (64, 16, 64)  # one bit per element
  keep = np.asarray(unpack_keep_mask(bits, 512))
  np.testing.assert_array_equal(keep, np.unpackbits(np.asarray(bits), axis=-1,
                                                    bitorder="little").astype(bool))
  n = keep.size
  assert abs(keep.mean() - 0.9) < 5 * np.sqrt(0.9 * 0.1 / n)
  # Two neighbours come from one Threefry block's two words: they must still be independent.
  both = (keep[..., 0::2] & keep[..., 1::2]).mean()
  assert abs(both - 0.81) < 5 * np.sqrt(0.81 * 0.19 / (n // 2))
  np.testing.assert_array_equal(keep_mask_bits(key, (64, 16, 512), 0.9), bits)
  other = np.asarray(unpack_keep_mask(keep_mask_bits(jax.random.key(4), (64, 16, 512), 0.9),
                                      512))
  assert 0.15 < (other != keep).mean() < 0.21  # 2 * 0.9 * 0.1 = 0.18 for independent masks
  # The keep rule is jax.random.bernoulli's, bit for bit where the same words are used (an odd
  # last axis draws one word per element, as jax.random.bits does).
  for p in (0.9, 0.5, 0.123):
    odd = keep_mask_bits(key, (4, 33, 7), p)
    assert odd.dtype == jnp.bool_
    np.testing.assert_array_equal(odd, jax.random.bernoulli(key, p, (4, 33, 7)))


def test_adapters_need_less_scratch_memory_than_full_fine_tuning():
  """Compiled per-device temporaries of the LoRA and QLoRA steps (adapter dropout on) against
  full fine-tuning of the same model: the adapter path keeps only x, packed 1-bit keep masks and
  rank-sized activations for the backward, and a QLoRA base is dequantized in each pass rather
  than kept in full precision."""
  mesh, rules = mesh_and_rules("fsdp", 4, 2)
  batch = packed_batches(1, batch=8, seq_len=64, vocab=TINY1.vocab_size)[0]
  model = random_model(TINY1, seed=0, init=FAN_IN, mesh=mesh, strategy="fsdp")
  temp = lambda engine: engine.runner.stats["temp_size_in_bytes"]
  full = tiny_engine(model, batch, mesh, rules, steps=4)
  for base_qtype in (None, "nf4"):
    lora = apply_lora(model, module_regex=r"layers/.*/(attn|mlp)/.*", rank=4, dropout=0.1,
                      base_qtype=base_qtype, base_tile_size=8 if base_qtype else None)
    engine = tiny_engine(lora, batch, mesh, rules, steps=4,
                         objective=with_lora_dropout(lm_objective), trainable=LoRAParam)
    assert temp(engine) < temp(full), (base_qtype, temp(engine), temp(full))


def test_the_shipped_regex_adapts_every_block_matmul_scanned_or_unrolled():
  """distillax/configs/lora.py's module_regex reaches the attention and MLP weights whether the
  layers are unrolled ('layers/0/attn/q') or stacked for scan ('layers/attn/q'), and the two
  adapted models compute the same logits once their adapters hold the same values."""
  from distillax.configs import lora as lora_config
  from distillax.models.transformer import with_layer_layout

  regex = lora_config.get_config("tiny").lora.module_regex
  two_layers = TINY.replace(num_layers=2)
  unrolled = random_model(two_layers, seed=0, init=FAN_IN)
  scanned = with_layer_layout(random_model(two_layers, seed=0, init=FAN_IN), scan_layers=True)
  adapted = {name: apply_lora(m, module_regex=regex, rank=4)
             for name, m in (("unrolled", unrolled), ("scanned", scanned))}
  pure = {name: nnx.to_pure_dict(nnx.state(m, LoRAParam)) for name, m in adapted.items()}
  count = lambda tree: sum(jax.tree_util.keystr(p).endswith("['lora_a']")
                           for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
  assert count(pure["unrolled"]) == 2 * 7 and count(pure["scanned"]) == 7  # q k v o gate up down
  # The same nonzero adapters in both layouts: B off zero, so the adapters change the logits.
  rng = np.random.default_rng(4)
  values = jax.tree.map(lambda x: (rng.normal(size=x.shape) * 0.1).astype(np.float32),
                        pure["unrolled"])
  state = nnx.state(adapted["unrolled"], LoRAParam)
  nnx.replace_by_pure_dict(state, values)
  nnx.update(adapted["unrolled"], state)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *[values["layers"][i] for i in range(2)])
  state = nnx.state(adapted["scanned"], LoRAParam)
  nnx.replace_by_pure_dict(state, {**values, "layers": stacked})
  nnx.update(adapted["scanned"], state)
  x = tokens(2, 16, TINY.vocab_size, seed=3)
  base = logits(unrolled, x)
  out = {name: logits(m, x) for name, m in adapted.items()}
  assert np.abs(out["unrolled"] - base).max() > 1e-2  # the adapters are in use
  np.testing.assert_allclose(out["scanned"], out["unrolled"], rtol=1e-5, atol=1e-5)
