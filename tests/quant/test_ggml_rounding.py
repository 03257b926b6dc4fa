"""llama.cpp's q4_0 / q8_0 rounding as distillax computes it, on the device that runs the tests,
against numpy transcriptions of ggml's quantizers (tests/quant/helpers.py) bit for bit: the
weights' blocks, the CPU kernel's activation blocks, and a q4_0 QAT forward. test_ggml.py pins
the transcriptions to gguf.quants (llama.cpp's own numpy code); this module needs no gguf, so the
chip run (scripts/chip_tests.sh) checks the TPU's rounding with it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.quant import find_matmul_sites, ggml, quantize_for_training
from distillax.quant.fakequant import fake_quantize
from tests.quant.helpers import (GGML_BLOCK, awkward_weights, gguf_rows, np_cpu_q8_0,
                                 np_ggml_blocks, np_ggml_rounded, np_ggml_rounded_rows, tokens)
from tests.support import chip
from tests.support.models import FAN_IN, TINY1, logits, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
# (shape, contracted axes): odd free dims, contractions over one axis (first, middle or last)
# and over two (attention's output weight, (heads, head_dim, embed)): blocks cut where they lie;
# and over two apart, which ggml.fake_quantize first moves last as GGUF's rows.
SHAPES = [((7, 96), (1,)), ((96, 5), (0,)), ((3, 64, 5), (1,)), ((4, 16, 13), (0, 1)),
          ((2, 3, 32, 7), (2,)), ((2, 5, 32), (0, 2))]


def assert_same_blocks(got_rows, want_rows, scales_f16):
  """Bit for bit; on a difference, how many blocks differ and how many of those have an fp16
  scale that is subnormal (below 6.1e-5, where a device that flushes fp16 subnormals parts)."""
  got = np.asarray(got_rows, np.float32).reshape(-1, GGML_BLOCK).view(np.uint32)
  want = np.asarray(want_rows, np.float32).reshape(-1, GGML_BLOCK).view(np.uint32)
  differ = (got != want).any(axis=-1)
  scales = np.abs(np.asarray(scales_f16, np.float32).reshape(-1))
  subnormal = (scales > 0) & (scales < np.finfo(np.float16).tiny)
  assert not differ.any(), (
      f"{int(differ.sum())} of {differ.size} blocks differ from ggml's rounding, "
      f"{int((differ & subnormal).sum())} of them with a subnormal fp16 scale "
      f"({int(subnormal.sum())} such blocks in all); first differing block "
      f"{int(np.argmax(differ))}: got {got_rows.reshape(-1, GGML_BLOCK)[np.argmax(differ)]}, "
      f"want {want_rows.reshape(-1, GGML_BLOCK)[np.argmax(differ)]}")


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
@pytest.mark.parametrize("shape,contract", SHAPES)
def test_rounding_equals_the_numpy_reference_bit_for_bit(qtype, shape, contract):
  """ggml.fake_quantize (what QAT and PTQ run) under jit, blocks of every magnitude (fp16
  subnormal scales to 150), an all-zero block, a constant one, a ±max one."""
  w = awkward_weights(shape, seed=len(shape) + sum(shape))
  rows = gguf_rows(w, contract)
  rounded = jax.jit(ggml.fake_quantize, static_argnums=(1, 2))(jnp.asarray(w), qtype, contract)
  assert_same_blocks(gguf_rows(np.asarray(rounded), contract),
                     np_ggml_rounded_rows(rows, qtype), np_ggml_blocks(rows, qtype)[0])


def test_activations_round_like_the_cpu_kernel():
  x = np.random.default_rng(8).normal(size=(5, 4, 96)).astype(np.float32)
  # A block with exact halves (amax 127: multiplier 1): the kernel rounds them to even, the
  # weight quantizer (roundf) away from zero.
  x[0, 0, :32] = np.float32(0.5)
  x[0, 0, :6] = [127, 2.5, -3.5, 0.5, -0.5, 1.5]
  got = np.asarray(fake_quantize(jnp.asarray(x), "q8_0", (0, 1), ()))
  want = np_cpu_q8_0(x.reshape(5, 4, 3, 32)).reshape(x.shape)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got[0, 0, :6], [127, 2, -4, 0, 0, 2])
  as_weight = np.asarray(ggml.fake_quantize(jnp.asarray(x[0, 0, :32]), "q8_0", (0,)))
  np.testing.assert_array_equal(as_weight[:6], [127, 3, -4, 1, -1, 2])


def test_qat_q4_0_forward_equals_the_model_on_numpy_rounded_weights():
  """Every matmul weight q4_0 (QAT rounds where it reads them, inside the jitted forward) against
  the plain model whose weights numpy rounded: the same logits; both far from the
  full-precision model's. On a TPU within chip.F32 of their scale (tests/support/chip.py)."""
  model = random_model(TINY1, seed=0, init=FAN_IN)
  toks = tokens(2, 16, TINY1.vocab_size)
  ours = np.asarray(logits(quantize_for_training(model, {"rules": ((".*", "q4_0", None, None),)}),
                           toks))
  reference = random_model(TINY1, seed=0, init=FAN_IN)
  sites = find_matmul_sites(reference)
  assert len(sites) == 8 and all(s.stacked == 0 for s in sites)  # q, k, v, o, 3 mlp, lm_head
  for site in sites:
    param = reference
    for key in site.weight_path:
      param = param[key] if isinstance(key, int) else getattr(param, key)
    w = np.asarray(param[...], np.float32)
    param.set_value(jnp.asarray(np_ggml_rounded(w, "q4_0", site.contract_axes)))
  theirs = np.asarray(logits(reference, toks))
  chip.assert_close(ours, theirs, rtol=0, atol=1e-5)
  assert np.abs(ours - np.asarray(logits(model, toks))).max() > 1e3 * 1e-5


def test_scales_round_to_float16_as_numpy_does():
  """The fp16 rounding of the scales, done in integer arithmetic (the TPU compiler folds a
  jitted float32 -> float16 -> float32 round trip away), against numpy's cast bit for bit:
  every exponent from fp16's subnormals to past its largest value, and the exact midpoints
  between neighbouring fp16 numbers (ties to even), normal and subnormal."""
  rng = np.random.default_rng(3)
  spread = (rng.uniform(1, 2, 4000) * 2.0 ** rng.integers(-30, 18, 4000)).astype(np.float32)
  halves = np.arange(0, 2 ** 15 - 1024, 7, dtype=np.uint16).view(np.float16).astype(np.float32)
  nexts = (np.arange(0, 2 ** 15 - 1024, 7, dtype=np.uint16) + 1).view(np.float16)
  midpoints = (halves + nexts.astype(np.float32)) / 2  # exact in float32
  x = np.concatenate([spread, midpoints, [0.0, 65504.0, 65519.0, 65520.0, 2.0 ** -25,
                                          3 * 2.0 ** -26, np.inf]]).astype(np.float32)
  x = np.concatenate([x, -x])
  got = np.asarray(jax.jit(ggml._f16_rounded)(jnp.asarray(x)))
  want = x.astype(np.float16).astype(np.float32)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
