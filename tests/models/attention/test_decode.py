"""The decode kernel (attention/decode.py) against the reference attention, and a scanned model
decoding through it against uncached recomputation. On CPU the Pallas interpreter runs it; on
the chip (scripts/chip_tests.sh) the Mosaic kernel, at the shapes the real student decodes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import partitioning as pt

from distillax.errors import UserError
from distillax.models.attention import impl as attention_impl
from distillax.models.attention import layer as attention_layer
from distillax.models.attention.cache_slot import dequantize_rows, quantize_rows
from distillax.models.attention.decode import (key_block, layout, resolve_layout,
                                               stacked_decode_attention)
from distillax.models.attention.impl import AttentionNeeds, choose
from distillax.models.attention.kv_cache import KVCache
from distillax.models.attention.layer import reference_attention
from distillax.models.init import model_shardings
from distillax.models.presets import get_preset
from distillax.models.sampler import SamplingConfig, decode, generate
from distillax.models.transformer import with_layer_layout
from tests.models.test_sampler import LENGTHS, PROMPTS, _uncached_greedy
from tests.support import chip
from tests.support.models import random_model

CASES = {  # dtype, soft-cap, window (slots back), filled slots of the cache
    "f32-causal-padded-rows": ("float32", None, None, 150),
    "bf16-window-softcap": ("bfloat16", 20.0, 40, 300),
    "bf16-full-cache": ("bfloat16", None, None, None),
}


# The kernel's schedule (decode.stacked_decode_attention's default), and the earlier one
# benchmarks/decode_kernel.py measures it against.
SCHEDULES = {"default": {}, "earlier": dict(prefetch_next_rows=False)}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("case", list(CASES))
def test_decode_kernel_matches_reference(case, schedule):
  """One query per row against layer 1 of a 3-layer stack: rows whose first slots are prompt
  padding (segment 0), a causal limit inside the cache (the blocks past it neither read nor
  computed: 3 blocks of 128 on CPU, the last skipped, where the next row's first block is
  fetched), GQA (2 query heads a kv head), a window and a soft-cap. float32 against the
  reference's float32; bfloat16 against the float32 reference of the same rounded inputs
  (tests/support/chip.py)."""
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
                                   interpret=chip.interpret(), **SCHEDULES[schedule])
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


def test_layout_takes_the_most_rows_a_step_whose_blocks_fit_two_mib():
  bf16_rows = 8 * 128 * 2
  assert layout(32, 1024, bf16_rows) == (128, 8)  # 8 rows x 128 slots x 2 KiB = 2 MiB
  assert layout(32, 1024, bf16_rows // 2) == (256, 8)  # int8 codes: 1 KiB a slot
  assert layout(32, 1024, 2 * bf16_rows) == (128, 4)  # float32: 8 rows would need 64 slots
  assert layout(6, 1024, bf16_rows) == (512, 2)  # 6 rows: 2 a step
  assert layout(3, 1024, bf16_rows) == (1024, 1)
  assert resolve_layout(32, 1024, bf16_rows) == (128, 8)
  assert resolve_layout(32, 1024, bf16_rows, rows_per_step=1) == (1024, 1)  # the first layout
  assert resolve_layout(32, 1024, bf16_rows, block=512, rows_per_step=2) == (512, 2)


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


@pytest.mark.parametrize("rows_per_step", [None, 1])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_int8_cache_kernel_matches_reference_on_its_dequantized_values(schedule, rows_per_step):
  """An int8 cache's codes and per-(slot, head) scales through the kernel against the reference
  attention over the same codes dequantized: the kernel's scaling after its products is the
  reference's before them (bf16 queries, as a decode step runs). The cache is filled to under
  half, so blocks are skipped, after one group of rows or, one row a step, between groups."""
  N, B, S, K, G, H = chip.pick(cpu=(2, 2, 256, 2, 2, 128), tpu=(2, 4, 1024, 8, 2, 128))
  rng = np.random.default_rng(2)
  raw = [jnp.asarray(rng.normal(size=(N, B, S, K, H)) * rng.uniform(0.1, 3, (N, B, S, K, 1)),
                     jnp.float32) for _ in range(2)]
  (k, ks), (v, vs) = (quantize_rows(x.reshape(N * B, S, K, H)) for x in raw)
  k, v = k.reshape(N, B, S, K, H), v.reshape(N, B, S, K, H)
  ks, vs = ks.reshape(N, B, 1, S * K), vs.reshape(N, B, 1, S * K)
  q = jnp.asarray(rng.normal(size=(B, K, G, H)), jnp.bfloat16)
  filled = S // 2 - 37
  valid = jnp.broadcast_to(jnp.arange(S) < filled, (B, S))
  with chip.precision(jnp.bfloat16):
    got = stacked_decode_attention(q, k, v, 1, valid, filled, ks, vs, scale=H ** -0.5,
                                   interpret=chip.interpret(), rows_per_step=rows_per_step,
                                   **SCHEDULES[schedule])
  deq = lambda codes, scale: dequantize_rows(codes[1], scale[1].reshape(B, S, K), jnp.float32)
  index = jnp.broadcast_to(jnp.arange(S), (B, S))
  want, _ = reference_attention(q.astype(jnp.float32)[:, None], deq(k, ks), deq(v, vs),
                                q_index_BxL=jnp.full((B, 1), filled - 1), k_index_BxS=index,
                                scale=H ** -0.5)
  chip.assert_bf16(np.asarray(got), np.asarray(want[:, 0]))


def test_int8_codes_are_within_half_a_step_of_each_feature():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 2, 64)) * 4, jnp.float32)
  codes, scale = quantize_rows(x)
  assert codes.dtype == jnp.int8 and scale.shape == (3, 5, 2)
  back = dequantize_rows(codes, scale, jnp.float32)
  assert np.all(np.abs(np.asarray(back - x)) <= np.asarray(scale)[..., None] / 2 + 1e-6)
  assert np.all(np.abs(np.asarray(codes)).max(-1) == 127)  # each row's largest hits the edge


def test_an_int8_cache_decodes_through_kernel_and_reference_alike_and_near_the_exact_cache(
    monkeypatch):
  """A scanned tiny model's int8-cached greedy decode: the kernel's tokens (interpreter on CPU)
  are those of the reference over the dequantized cache; and the first decode step's logits
  are near those of the exact cache (each key and value off by at most half a code)."""
  model = with_layer_layout(random_model(get_preset("tiny", qk_norm=True), seed=3), True)
  prompts = np.array([[5, 9, 2, 7, 3, 1], [42, 17, 0, 0, 0, 0]], np.int32)
  lengths = np.array([6, 2], np.int32)
  via = lambda kernel: _int8_greedy(model, prompts, lengths, kernel, monkeypatch)
  np.testing.assert_array_equal(via(True), via(False))
  exact, int8 = (_first_step_logits(model, prompts, dtype) for dtype in (None, "int8"))
  chip.assert_scaled(int8, exact, 2e-2, "first decode step's logits")


def test_an_int8_cache_needs_a_scanned_attention_stack():
  with pytest.raises(UserError, match="int8 KV cache needs a scanned stack"):
    KVCache.zeros(get_preset("tiny"), 2, 8, "int8")


def _int8_greedy(model, prompts, lengths, kernel: bool, monkeypatch):
  calls = []

  def counted(*args, **kwargs):
    calls.append(1)
    return stacked_decode_attention(*args, **kwargs, interpret=chip.interpret())

  with monkeypatch.context() as m:
    if kernel:
      m.setattr(attention_impl, "decode_unsupported",
                lambda requested, platform, needs: None if needs.stacked_cache else "no")
      m.setattr(attention_layer, "stacked_decode_attention", counted)
    out = decode(model, jnp.asarray(prompts), jnp.asarray(lengths), jax.random.key(0),
                 SamplingConfig(10), cache_dtype="int8")
  assert bool(calls) == kernel
  return np.asarray(out.tokens_BxT)


def _first_step_logits(model, prompts, cache_dtype):
  B, P = prompts.shape
  cache = KVCache.zeros(model.config, B, P + 2, cache_dtype)
  out = model(jnp.asarray(prompts), cache=cache, return_logits=False)
  step = model(jnp.asarray(prompts[:, -1:]), positions_BxL=jnp.full((B, 1), P, jnp.int32),
               cache=out.cache)
  return np.asarray(step.logits_BxLxV[:, 0], np.float32)


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_a_sharded_model_decodes_through_the_kernel_per_device_like_one_device(
    cache_dtype, monkeypatch):
  """Rows over the data axis and kv heads over the model axis (fsdp_tp on 4 x 2 devices; 1 x 1
  on a single chip, where the shard_map still wraps the kernel): the kernel runs inside a
  shard_map on each device's rows and heads, and the tokens are one device's. An int8 cache's
  scales interleave the heads, so with heads split it attends by the reference path (the kernel
  is not called) and still decodes the same tokens."""
  model = with_layer_layout(random_model(get_preset("tiny"), seed=4), True)
  prompts = np.tile(PROMPTS, (3, 1))[:8]
  lengths = np.tile(LENGTHS, 3)[:8]
  run = lambda **mesh: np.asarray(decode_sharded(model, prompts, lengths, cache_dtype, **mesh))
  plain = run()
  calls = []

  def kernel(*args, **kwargs):
    calls.append(1)
    return stacked_decode_attention(*args, **kwargs, interpret=chip.interpret())

  monkeypatch.setattr(attention_impl, "decode_unsupported",
                      lambda requested, platform, needs: None if needs.stacked_cache else "no")
  monkeypatch.setattr(attention_layer, "stacked_decode_attention", kernel)
  heads_split = jax.device_count() >= 8
  mesh = pt.create_mesh({"data": 4, "model": 2} if heads_split else {"data": 1, "model": 1})
  np.testing.assert_array_equal(run(mesh=mesh, rules=pt.rules_from_config(
      {"strategy": "fsdp_tp"})), plain)
  assert bool(calls) == (cache_dtype is None or not heads_split)


def decode_sharded(model, prompts, lengths, cache_dtype, mesh=None, rules=None):
  steps = 10  # 6 + 10 = 16 slots
  if mesh is None:
    return decode(model, jnp.asarray(prompts), jnp.asarray(lengths), jax.random.key(0),
                  SamplingConfig(steps), cache_dtype=cache_dtype).tokens_BxT
  shardings = model_shardings(model, mesh, rules)
  graphdef, state = nnx.split(model)
  placed = nnx.merge(graphdef, jax.tree.map(jax.device_put, nnx.to_pure_dict(state), shardings))

  @jax.jit
  def run(state, prompts, lengths):
    with pt.use_rules(mesh, rules):
      return decode(nnx.merge(graphdef, state), prompts, lengths, jax.random.key(0),
                    SamplingConfig(steps), cache_dtype=cache_dtype).tokens_BxT
  return run(nnx.state(placed), jnp.asarray(prompts), jnp.asarray(lengths))
