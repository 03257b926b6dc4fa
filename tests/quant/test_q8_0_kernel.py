"""QAT's q8_0 activation rounding as a Pallas kernel (quant/q8_0_kernel.py): the same bits as
the rounding by blocks (ggml.activation_in_blocks, which test_ggml_rounding holds to a numpy
transcription of ggml's quantizer), in the Pallas interpreter here and as the Mosaic kernel on
the chip (scripts/chip_tests.sh); where the kernel is used and where the blocks stay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax import partitioning as pt
from distillax.quant import ggml, q8_0_kernel
from tests.support import chip


def _activations(rows: int, k: int, seed: int) -> np.ndarray:
  """Normal values with the blocks the rounding treats apart: all zero, a float16-subnormal
  scale (amax / 127 < 2^-14), a scale past float16 (amax / 127 > 65504: inf), values on
  half-way points of their block's grid, and a block whose largest value is negative."""
  x = np.random.default_rng(seed).normal(size=(rows, k)).astype(np.float32)
  x[0, :32] = 0.0
  x[1, 32:64] *= 1e-4
  x[2, 64:96] *= 1e7
  step = np.abs(x[3, 96:128]).max() / 127
  x[3, 96:128] = (np.arange(32) - 16.5) * step  # k + 1/2 grid steps: ties to even
  x[3, 96] = -np.abs(x[3, 96:128]).max() * 1.01
  return x


@pytest.mark.parametrize("k,dtype,tile_rows,kernel", [
    (128, jnp.float32, 16, "lanes"), (384, jnp.bfloat16, None, "lanes"),
    (1024, jnp.bfloat16, None, "lanes"),
    (128, jnp.float32, None, "transposed"), (384, jnp.bfloat16, None, "transposed"),
    (1024, jnp.bfloat16, None, "transposed")])
def test_the_kernel_rounds_the_bits_the_blocks_do(k, dtype, tile_rows, kernel):
  # Tiles of 16 rows (lanes) or 128 (transposed): the last one ragged; the chip: real sizes.
  rows = chip.pick(40 if kernel == "lanes" else 328, 2048)
  x = jnp.asarray(_activations(rows, k, seed=k), dtype).reshape(2, rows // 2, k)
  got = q8_0_kernel.fake_quantize_rows(x, interpret=chip.interpret(), tile_rows=tile_rows,
                                       kernel=kernel)
  want = jax.jit(lambda x: ggml.activation_in_blocks(x, [2]))(x)
  assert got.dtype == want.dtype and got.shape == want.shape
  got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
  np.testing.assert_array_equal(got, want)
  assert np.isinf(want).any() and (want == 0).any()  # the blocks above were reached


def test_the_kernel_is_used_only_where_its_blocks_lie_along_whole_lanes():
  x = jnp.zeros((4, 256), jnp.bfloat16)
  assert q8_0_kernel.applies(x, [1]) and q8_0_kernel.applies(x, [-1])
  assert not q8_0_kernel.applies(jnp.zeros((4, 96)), [1])  # 3 blocks: not whole lanes
  assert not q8_0_kernel.applies(jnp.zeros((256, 4)), [0])  # blocks across rows
  assert not q8_0_kernel.applies(jnp.zeros((4, 2, 128)), [1, 2])
  one = pt.create_mesh({"data": 1, "model": 1}, devices=jax.devices()[:1])
  with pt.use_rules(one, pt.rules_from_config({"strategy": "fsdp"})):
    assert q8_0_kernel.applies(x, [1])
  many = pt.create_mesh({"data": 4, "model": 2})
  with pt.use_rules(many, pt.rules_from_config({"strategy": "fsdp"})):
    assert not q8_0_kernel.applies(x, [1])  # a kernel GSPMD cannot partition


@pytest.mark.parametrize("shape,contract", [((16, 256), [1]), ((2, 8, 2, 128), [2, 3])])
def test_fake_quantize_activation_lowers_the_kernel_for_a_tpu_only(shape, contract):
  """Also for attention's output input, (tokens, heads, head_dim) contracting the last two:
  blocks of 32 over heads x head_dim in order are the blocks of head_dim alone."""
  x = jnp.asarray(_activations(16, 256, seed=3).reshape(shape))
  round_it = jax.jit(lambda x: ggml.fake_quantize_activation(x, "q8_0", contract))
  assert "tpu_custom_call" in round_it.trace(x).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" not in round_it.trace(x).lower(lowering_platforms=("cpu",)).as_text()
  want = ggml.activation_in_blocks(x, contract)
  np.testing.assert_array_equal(np.asarray(round_it(x)), np.asarray(want))
  np.testing.assert_array_equal(
      np.asarray(q8_0_kernel.fake_quantize_rows(x, interpret=True)), np.asarray(want))
