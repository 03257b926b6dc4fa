"""The decode kernel (attention/decode.py) against the reference attention, and a scanned model
decoding through it against uncached recomputation. On CPU the Pallas interpreter runs it; on
the chip (scripts/chip_tests.sh) the Mosaic kernel, at the shapes the real student decodes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.models.attention import impl as attention_impl
from distillax.models.attention import layer as attention_layer
from distillax.models.attention.decode import key_block, stacked_decode_attention
from distillax.models.attention.impl import AttentionNeeds, choose
from distillax.models.attention.layer import reference_attention
from distillax.models.presets import get_preset
from distillax.models.sampler import generate
from distillax.models.transformer import with_layer_layout
from tests.models.test_sampler import _uncached_greedy
from tests.support import chip
from tests.support.models import random_model

CASES = {  # dtype, soft-cap, window (slots back), filled slots of the cache
    "f32-causal-padded-rows": ("float32", None, None, 150),
    "bf16-window-softcap": ("bfloat16", 20.0, 40, 300),
    "bf16-full-cache": ("bfloat16", None, None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_kernel_matches_reference(case):
  """One query per row against layer 1 of a 3-layer stack: rows whose first slots are prompt
  padding (segment 0), a causal limit inside the cache (the blocks past it neither read nor
  computed: 3 blocks of 128 on CPU, the last skipped), GQA (2 query heads a kv head), a window
  and a soft-cap. float32 against the reference's float32; bfloat16 against the float32
  reference of the same rounded inputs (tests/support/chip.py)."""
  dtype_name, softcap, window, filled = CASES[case]
  N, B, S, K, G, H = chip.pick(cpu=(3, 3, 384, 2, 2, 128), tpu=(3, 4, 1024, 8, 2, 128))
  filled = S if filled is None else chip.pick(filled, 3 * filled)
  dtype = jnp.dtype(dtype_name)
  rng = np.random.default_rng(1)
  k, v = (jnp.asarray(rng.normal(size=(N, B, S, K, H)), dtype) for _ in range(2))
  q = jnp.asarray(rng.normal(size=(B, K, G, H)), dtype)
  k_index = jnp.broadcast_to(jnp.arange(S), (B, S))
  q_index = jnp.full((B, 1), filled - 1)
  pad_B = jnp.asarray([0, 7, 33, 100][:B])
  k_segment = (k_index >= pad_B[:, None]).astype(jnp.int32)
  q_segment = jnp.ones((B, 1), jnp.int32)
  valid = (k_index <= q_index) & (k_segment == 1)
  if window is not None:
    valid &= (q_index - k_index) < window
  with chip.precision(dtype):
    got = stacked_decode_attention(q, k, v, 1, valid, filled, scale=H ** -0.5, softcap=softcap,
                                   interpret=chip.interpret())
  f32 = lambda x: x.astype(jnp.float32)
  want, _ = reference_attention(f32(q)[:, None], f32(k[1]), f32(v[1]), q_index_BxL=q_index,
                                k_index_BxS=k_index, q_segment_BxL=q_segment,
                                k_segment_BxS=k_segment, window=window, scale=H ** -0.5,
                                softcap=softcap)
  chip.assert_close(np.asarray(got), np.asarray(want[:, 0]), dtype=dtype, atol=2e-6, rtol=2e-5)


def test_key_blocks_divide_the_cache_within_their_bytes_or_refuse():
  bf16_rows = 8 * 128 * 2  # the real student's 8 kv heads of 128 features
  assert [key_block(n, bf16_rows) for n in (1024, 1536, 384, 13, 16, 4096)] == [
      1024, 512, 128, None, 16, 1024]
  assert key_block(1024, 2 * bf16_rows) == 512  # float32: 1,024 slots would be 4 MiB a block


def test_decode_is_chosen_on_a_tpu_for_a_stacked_cache_only():
  stacked = AttentionNeeds(cached=True, query_len=1, key_len=1024, stacked_cache=True)
  assert choose("auto", "tpu", stacked)[0] == "decode"
  assert choose("auto", "cpu", stacked)[0] == "reference"
  assert choose("blockwise", "tpu", stacked)[0] == "reference"
  unstacked = AttentionNeeds(cached=True, query_len=1, key_len=1024)
  assert choose("auto", "tpu", unstacked)[0] == "reference"
  sinks = AttentionNeeds(cached=True, query_len=1, key_len=1024, stacked_cache=True, sinks=True)
  assert choose("auto", "tpu", sinks)[0] == "reference"


@pytest.mark.parametrize("name, overrides", [
    ("tiny", dict(qk_norm=True)),
    ("tiny_gemma", {}),  # soft-capped logits, a sliding window (8) shorter than the text
])
def test_scanned_model_decoding_through_the_kernel_equals_uncached_greedy(
    name, overrides, monkeypatch):
  """The kernel chosen as on a TPU (the platform check patched, the interpreter on CPU): a
  scanned model's cached greedy tokens are those of recomputing the whole text each step."""
  monkeypatch.setattr(attention_impl, "decode_unsupported",
                      lambda requested, platform, needs: None if needs.stacked_cache else "no")
  calls = []

  def kernel(*args, **kwargs):
    calls.append(1)
    return stacked_decode_attention(*args, **kwargs, interpret=chip.interpret())

  monkeypatch.setattr(attention_layer, "stacked_decode_attention", kernel)
  model = with_layer_layout(random_model(get_preset(name, **overrides), seed=3), True)
  prompts = np.array([[5, 9, 2, 7, 3, 1], [42, 17, 0, 0, 0, 0], [1, 2, 3, 4, 0, 0]], np.int32)
  lengths = np.array([6, 2, 4], np.int32)
  steps = 10  # 6 + 10 = 16 slots: blocks the kernel takes
  got = generate(model, prompts, lengths, max_new_tokens=steps)
  assert calls, "the decode steps did not run the kernel"
  want, _ = _uncached_greedy(model, prompts, lengths, steps)
  np.testing.assert_array_equal(np.asarray(got.tokens_BxT), want)
