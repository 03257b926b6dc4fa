"""QAT, LoRA and QLoRA on a mixture of experts: the experts' grouped matmuls (ragged_dot) are
fake-quantized per expert as llama.cpp stores them (checked against gguf's numpy quantizer on
the dense reference dispatch), q8_0 activations reach them, the router stays full precision;
adapters are per expert (B = 0 is the base model, the merged model computes the adapter
forward); all of them train through the real engine."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.models.presets import get_preset
from distillax.models.transformer import with_config
from distillax.quant import (LoRAParam, QuantConfig, QuantSiteParam, apply_lora,
                             find_matmul_sites, intercept, merge_lora, quantize_for_training,
                             quantize_post_training, with_lora_dropout)
from distillax.trainers import lm_objective
from tests.quant.helpers import tokens
from tests.support.engines import mesh_and_rules, packed_batches, run_steps, tiny_engine
from tests.support.models import FAN_IN, forward, logits, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MOE = get_preset("tiny_moe", num_layers=1, vocab_size=128)  # 4 experts, top 2, D 64, F 32
EXPERTS = ("gate", "up", "down")
Q4_EXPERTS = (("layers/(.*/)?mlp", "q4_0", None, None),)  # the MoE block: router and experts
TOKENS = tokens(2, 16, MOE.vocab_size)


@pytest.fixture(scope="module")
def model():
  return random_model(MOE, seed=0, init=FAN_IN)


def gguf_rounded(w_ExKxN: np.ndarray, qtype) -> np.ndarray:
  """Each expert's (K, N) matrix as llama.cpp stores it: rows of N outputs, blocks of 32 along
  the contracted K, quantized and dequantized by gguf's own numpy code."""
  rows_ExNxK = np.swapaxes(np.asarray(w_ExKxN, np.float32), 1, 2)
  back = gguf.quants.dequantize(gguf.quants.quantize(rows_ExNxK, qtype), qtype)
  return np.swapaxes(back.reshape(rows_ExNxK.shape), 1, 2)


def test_the_experts_are_grouped_matmul_sites_and_the_router_is_kept_full_precision(model):
  sites = {s.name: s for s in find_matmul_sites(model)}
  for name in EXPERTS:  # (E, K, N): one matrix per expert, K contracted
    assert (sites[f"layers/0/mlp/{name}"].contract_axes,
            sites[f"layers/0/mlp/{name}"].batch_axes) == ((1,), (0,))
  assert sites["layers/0/mlp/router"].is_router and sites["layers/0/mlp/router"].batch_axes == ()
  qat = quantize_for_training(model, {"rules": Q4_EXPERTS})
  assert all(isinstance(getattr(qat.layers[0].mlp, n), QuantSiteParam) for n in EXPERTS)
  assert type(qat.layers[0].mlp.router) is nnx.Param


def test_qat_q4_0_experts_equal_the_dense_reference_on_gguf_rounded_weights(model):
  """Ours (ragged dispatch, experts rounded where read) vs the dense dispatch of a plain model
  whose experts gguf rounded: the same numbers; both far from the full-precision model."""
  ours = np.asarray(logits(quantize_for_training(model, {"rules": Q4_EXPERTS}), TOKENS))
  reference = with_config(model, moe_impl="dense")
  mlp = reference.layers[0].mlp
  for name in EXPERTS:
    w = getattr(mlp, name)
    w.set_value(jnp.asarray(gguf_rounded(w[...], gguf.GGMLQuantizationType.Q4_0)))
  theirs = np.asarray(logits(reference, TOKENS))
  full = np.asarray(logits(model, TOKENS))
  assert np.abs(ours - theirs).max() <= 1e-5
  assert np.abs(ours - full).max() > 1e3 * 1e-5


def test_q8_0_activations_reach_the_grouped_matmuls(model):
  """The rows entering each expert are rounded to q8_0 blocks as llama.cpp's kernels round
  them: ragged equals the dense reference (and tokamax's grouped matmul) under the same rules,
  and differs from weights-only QAT by far more than that agreement."""
  rules = (("layers/(.*/)?mlp", "q4_0", "q8_0", None),)
  ragged = np.asarray(logits(quantize_for_training(model, {"rules": rules}), TOKENS))
  weights_only = np.asarray(logits(quantize_for_training(model, {"rules": Q4_EXPERTS}), TOKENS))
  for impl in ("dense", "tokamax"):
    other = quantize_for_training(with_config(model, moe_impl=impl), {"rules": rules})
    assert np.abs(ragged - np.asarray(logits(other, TOKENS))).max() <= 1e-5, impl
  assert np.abs(ragged - weights_only).max() > 100 * 1e-5


def test_reads_feed_matmuls_in_order_when_a_cast_hides_their_identity():
  """An MoE reads gate, up and down, then runs their grouped matmuls: with the compute-dtype cast
  in between only shapes tell them apart, and gate and up share one, so the oldest read of the
  shape is the one taken (with every read older than it)."""
  intercept.clear_reads()
  stale, gate, up, down = (jnp.zeros(s) for s in [(64,), (4, 64, 32), (4, 64, 32), (4, 32, 64)])
  for owner, value in (("norm", stale), ("gate", gate), ("up", up), ("down", down)):
    intercept.note_read(owner, value)
  cast = lambda v: v.astype(jnp.bfloat16)
  x = jnp.zeros((5, 64))
  assert intercept.take_read((x, cast(gate)), sides=(1,))[0].owner == "gate"
  assert intercept.take_read((x, cast(up)), sides=(1,))[0].owner == "up"
  assert intercept.take_read((x, jnp.zeros((5, 64))), sides=(1,)) is None  # nothing feeds it
  assert intercept.take_read((x, down), sides=(1,))[0].owner == "down"
  assert intercept.take_read((x, cast(up)), sides=(1,)) is None  # consumed
  intercept.clear_reads()


def _train(student, batches, strategy="fsdp", **options):
  """Engine steps (jit, `strategy` over 4 x 2 devices); the state before and after."""
  mesh, rules = mesh_and_rules(strategy, 4, 2)
  engine = tiny_engine(student, batches[0], mesh, rules, steps=4, **options)
  state = engine.init_state(student, {}, seed=0)
  before = jax.device_get(state)
  state, losses = run_steps(engine, state, batches)
  return losses, before, jax.device_get(state)


def _mean_token_loss(model, batch) -> float:
  """Next-token cross-entropy over the batch's loss mask, from one plain jitted forward."""
  out = forward(model, jnp.asarray(batch["inputs_BxL"]), jnp.asarray(batch["positions_BxL"]),
                jnp.asarray(batch["segment_ids_BxL"]))
  logp = jax.nn.log_softmax(np.asarray(out.logits_BxLxV, np.float64), axis=-1)
  nll = -np.take_along_axis(np.asarray(logp), batch["targets_BxL"][..., None], -1)[..., 0]
  return float(np.sum(nll * batch["loss_mask_BxL"]) / np.sum(batch["loss_mask_BxL"]))


def test_a_qat_moe_student_trains_its_experts_exchanged_over_devices(model):
  """Under fsdp_ep each device runs its own experts' grouped matmuls inside the exchange: their
  input rows are rounded there as in one plain forward (the first step's loss is that
  forward's), and training moves the experts and the router."""
  batch = packed_batches(1, batch=8, seq_len=16, vocab=MOE.vocab_size, seed=3)[0]
  qat = quantize_for_training(model, {"rules": (("layers/(.*/)?mlp", "q4_0", "q8_0", None),)})
  expected = _mean_token_loss(qat, batch)
  losses, before, after = _train(qat, [batch] * 3, strategy="fsdp_ep")
  assert abs(losses[0] - expected) <= 1e-5, (losses[0], expected)
  assert losses[2] < losses[0] - 0.1, losses  # the same batch 3 times (step 0: warm-up lr 0)
  for name in EXPERTS + ("router",):
    w0 = np.asarray(before.params["layers"][0]["mlp"][name])
    assert not np.array_equal(w0, np.asarray(after.params["layers"][0]["mlp"][name])), name


def _randomize_b(model):
  for i, (path, var) in enumerate(nnx.iter_graph(model)):
    if isinstance(var, LoRAParam) and path[-1] == "lora_b":
      var.set_value(jnp.asarray(np.random.default_rng(i).normal(size=var.shape) * 0.1,
                                var.get_raw_value().dtype))


@pytest.mark.parametrize("regex", ["layers/.*/(attn|mlp)/.*", "layers/.*/attn/.*"])
def test_lora_on_an_moe_is_per_expert_starts_at_the_base_and_merges(model, regex):
  adapted = apply_lora(model, module_regex=regex, rank=4)
  base = np.asarray(logits(model, TOKENS))
  np.testing.assert_array_equal(np.asarray(logits(adapted, TOKENS)), base)  # B = 0
  mlp = adapted.layers[0].mlp
  if "mlp" in regex:  # one A (D, r) / B (r, F) per expert
    assert mlp.gate.lora_a.shape == (4, 64, 4) and mlp.gate.lora_b.shape == (4, 4, 32)
    assert mlp.down.lora_a.shape == (4, 32, 4) and mlp.down.lora_b.shape == (4, 4, 64)
  else:
    assert all(type(getattr(mlp, n)) is nnx.Param for n in EXPERTS + ("router",))
  _randomize_b(adapted)
  ours = np.asarray(logits(adapted, TOKENS))
  assert np.abs(ours - base).max() > 0.1
  np.testing.assert_allclose(np.asarray(logits(merge_lora(adapted), TOKENS)), ours,
                             rtol=0, atol=1e-4)


def test_a_qlora_moe_student_trains_and_merges(model):
  """nf4 bases for attention and experts (the router's stays full precision), adapters on
  all: B = 0 is the PTQ model of the same rules; trained adapters move, and the merged model
  computes the adapted forward."""
  adapted = apply_lora(model, module_regex="layers/.*", rank=4, base_qtype="nf4",
                       base_tile_size=16, dropout=0.1)
  ptq = quantize_post_training(model, QuantConfig.simple("nf4", None, 16, module_path="layers/.*"))
  np.testing.assert_allclose(logits(adapted, TOKENS), logits(ptq, TOKENS), rtol=0, atol=1e-5)
  assert type(adapted.layers[0].mlp.router.base) is nnx.Param
  batches = packed_batches(2, batch=8, seq_len=16, vocab=MOE.vocab_size, seed=4)
  losses, before, after = _train(adapted, batches, objective=with_lora_dropout(lm_objective),
                                 trainable=LoRAParam)
  assert np.all(np.isfinite(losses))
  flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(v)
                       for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
  b_before = {k: v for k, v in flat(before.params).items() if k.endswith("['lora_b']")}
  assert len(b_before) == 8 and all(not np.array_equal(v, flat(after.params)[k])
                                    for k, v in b_before.items())
  graphdef = nnx.split(adapted, LoRAParam, ...)[0]
  trained = nnx.merge(graphdef, after.params, after.frozen["student"])
  ours = np.asarray(logits(trained, TOKENS))
  assert np.abs(ours - np.asarray(logits(adapted, TOKENS))).max() > 1e-3  # it learned
  np.testing.assert_allclose(np.asarray(logits(merge_lora(trained), TOKENS)), ours,
                             rtol=0, atol=1e-4)
