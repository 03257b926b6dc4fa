"""llama.cpp's q8_0 / q4_0 blocks against the llama.cpp project's own numpy reference
(`gguf.quants`) bit for bit: the numpy transcriptions of ggml's quantizers (tests/quant/helpers.py)
that test_ggml_rounding.py holds distillax's rounding to, and the GGUF block bytes; also the
straight-through gradient, the activation blocks' layout, and how the rules accept and refuse
the types."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as GGMLType

from distillax import partitioning as pt
from distillax.errors import ConfigError, UserError
from distillax.models.presets import get_preset
from distillax.quant import (QuantConfig, QuantRule, WeightQuant, export_quantized, ggml,
                             quantize_for_training, quantize_post_training)
from distillax.quant.fakequant import (fake_quantize, fake_quantize_weight, ste_activation,
                                        ste_weight)
from tests.quant.helpers import (awkward_weights, gguf_rows, np_cpu_q8_0,
                                 np_ggml_rounded_rows, tokens)
from tests.support.models import FAN_IN, TINY1, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
GGML_TYPES = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}
# (shape, contracted axes): odd free dims, contractions over one axis (first, middle or last)
# and over two (attention's output weight, (heads, head_dim, embed)).
SHAPES = [((7, 96), (1,)), ((96, 5), (0,)), ((3, 64, 5), (1,)), ((4, 16, 13), (0, 1)),
          ((2, 3, 32, 7), (2,))]


@pytest.mark.parametrize("qtype", sorted(GGML_TYPES))
@pytest.mark.parametrize("shape,contract", SHAPES)
def test_numpy_reference_and_packed_bytes_equal_gguf_bit_for_bit(qtype, shape, contract):
  """The numpy transcription of ggml's quantizers (tests/quant/helpers.py; distillax's own
  rounding is checked against it in test_ggml_rounding.py, on whatever device runs the tests)
  rounds as gguf.quants does, and ggml.quantize's blocks pack to gguf's bytes."""
  rows = gguf_rows(awkward_weights(shape, seed=len(shape) + sum(shape)), contract)
  reference_bytes = gguf.quants.quantize(rows, GGML_TYPES[qtype])
  reference = gguf.quants.dequantize(reference_bytes, GGML_TYPES[qtype])
  np.testing.assert_array_equal(np_ggml_rounded_rows(rows, qtype).view(np.uint32),
                                reference.view(np.uint32))
  codes, scales = ggml.quantize(jnp.asarray(rows), qtype, (1,))
  packed = ggml.pack_blocks(np.asarray(codes), np.asarray(scales), qtype)
  np.testing.assert_array_equal(packed, reference_bytes)


@pytest.mark.parametrize("qtype", sorted(GGML_TYPES))
def test_stacked_layers_get_their_own_blocks(qtype):
  # Under scan_layers a weight carries a leading layer axis the matmul does not see.
  w = awkward_weights((3, 64, 6), seed=3)
  wq = WeightQuant(qtype, contract_axes=(0,), ndim=2)
  got = np.asarray(fake_quantize_weight(jnp.asarray(w), wq))
  for layer in range(3):
    reference = gguf.quants.dequantize(gguf.quants.quantize(
        np.ascontiguousarray(w[layer].T), GGML_TYPES[qtype]), GGML_TYPES[qtype])
    np.testing.assert_array_equal(got[layer].T, reference)


def test_weight_gradient_passes_straight_through():
  w = jnp.asarray(awkward_weights((64, 6), seed=4))
  upstream = jnp.asarray(np.random.default_rng(5).normal(size=(64, 6)), jnp.float32)
  for qtype in GGML_TYPES:
    wq = WeightQuant(qtype, contract_axes=(0,), ndim=2)
    grad = jax.grad(lambda x: jnp.sum(ste_weight(x, wq) * upstream))(w)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(upstream))
    assert not np.array_equal(np.asarray(ste_weight(w, wq)), np.asarray(w))  # it does round


def test_activation_gradient_passes_straight_through():
  x = jnp.asarray(np.random.default_rng(6).normal(size=(2, 3, 64)), jnp.float32)
  upstream = jnp.asarray(np.random.default_rng(7).normal(size=(2, 3, 64)), jnp.float32)
  grad = jax.grad(lambda v: jnp.sum(ste_activation(v, "q8_0", (0, 1), ()) * upstream))(x)
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(upstream))


def test_activation_blocks_follow_the_weights_input_layout():
  # The input of attention's output projection (B, L, heads, head_dim): one block spans two
  # heads of 16, as the GGUF [embed, heads * head_dim] weight's blocks do.
  x = np.random.default_rng(9).normal(size=(2, 3, 4, 16)).astype(np.float32)
  x[0, 0, 1, 0] = 40.0  # raises the scale of heads 0-1, not of heads 2-3
  got = np.asarray(fake_quantize(jnp.asarray(x), "q8_0", (0, 1), ()))
  want = np_cpu_q8_0(x.reshape(2, 3, 2, 32)).reshape(x.shape)
  np.testing.assert_array_equal(got, want)


def test_rules_accept_ggml_types_and_refuse_what_llama_cpp_lacks():
  assert QuantConfig.simple("q4_0", "q8_0").rules[0].weight_qtype == "q4_0"
  QuantRule(".*", "q8_0", "q8_0", 32)  # the fixed block size is fine to spell out
  with pytest.raises(ConfigError, match="tile_size=None"):
    QuantRule(".*", "q4_0", None, 64)
  with pytest.raises(ConfigError, match="act_qtype='q8_0'.*q4_0"):
    QuantRule(".*", "int4", "q8_0")


def test_contraction_not_a_multiple_of_32_is_refused():
  with pytest.raises(UserError, match="multiple of 32"):
    ggml.fake_quantize(jnp.ones((48, 4)), "q4_0", (0,))


def test_distillax_quantized_format_refuses_ggml_types(tmp_path):
  model = random_model(TINY1, seed=0, init=FAN_IN)
  with pytest.raises(UserError, match="--format gguf"):
    export_quantized(model, {"rules": ((".*", "q4_0", None, None),)}, tmp_path / "out")


# head_dim 24: a model shard of attention's output weight holds 2 heads = 48 inputs, and an FSDP
# shard of q/k/v 96 / 4 = 24, so blocks of 32 straddle shards; two layers, so that a float
# difference in the first can flip a q8_0 activation of the second.
HEAD_DIM_24 = get_preset("tiny", num_heads=4, num_kv_heads=2, head_dim=24, embed_dim=96,
                         mlp_dim=256, vocab_size=128, num_layers=2, scan_layers=False)
Q4_0_Q8_0_RULES = {"rules": [("", None, None, None), (".*", "q4_0", "q8_0", None)]}


def placed_logits(model, tokens_BxL, mesh, rules):
  """The forward as the engine traces it: under jit with the rules' activation constraints."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens_BxL):
    with pt.use_rules(mesh, rules):
      return nnx.merge(graphdef, state)(tokens_BxL).logits_BxLxV

  return np.asarray(forward(state, tokens_BxL))


@pytest.mark.parametrize("data,model", [(4, 2), (8, 1)])
def test_qat_forward_equals_ptq_on_tensor_and_data_parallel_meshes(data, model):
  # PTQ's forward is what the exported GGUF file computes; QAT must train that forward. A QAT
  # weight whose blocks straddle shards used to lose its sharding, so its matmul was summed in
  # another order than PTQ's and later q8_0 activations rounded differently (4e-3 here).
  mesh = pt.create_mesh({"data": data, "model": model})
  rules = pt.rules_from_config({"strategy": "fsdp_tp"})
  student = random_model(HEAD_DIM_24, seed=0, init=FAN_IN, mesh=mesh, strategy="fsdp_tp")
  batch = jax.device_put(tokens(8, 16, HEAD_DIM_24.vocab_size),
                         jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  qat = placed_logits(quantize_for_training(student, Q4_0_Q8_0_RULES), batch, mesh, rules)
  ptq = placed_logits(quantize_post_training(student, Q4_0_Q8_0_RULES), batch, mesh, rules)
  full = placed_logits(student, batch, mesh, rules)
  assert np.abs(ptq - full).max() > 1e-2  # the rounding is on
  np.testing.assert_allclose(qat, ptq, rtol=0, atol=1e-5)
