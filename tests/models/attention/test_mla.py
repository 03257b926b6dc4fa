"""DeepSeek's multi-head latent attention (models/attention/mla.py) beyond transformers' parity
(tests/models/hf/test_deepseek.py): the KV cache holds the latent and the RoPE key (sized by
hand for DeepSeek V3), cached generation over ragged prompts (attention in the latent) picks the
tokens the cache-free forward (expanded heads) picks, both orders give the same attention
probabilities, the padded-value blockwise path equals the reference in values and gradients,
FLOPs by hand, and the one-line refusals of what latent attention has no place for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.errors import ConfigError
from distillax.framework import flops
from distillax.models.attention.layer import KVCache, kv_cache_bytes_per_token
from distillax.models.presets import get_preset
from distillax.models.sampler import generate
from distillax.models.transformer import with_config
from tests.models.test_sampler import LENGTHS, PROMPTS, _uncached_greedy
from tests.support.models import forward, random_model

# tiny_deepseek_v3 without YaRN's long-context scaling (it is tested against transformers) but
# with rotate-half RoPE pairs, the form its interleaved twin is not.
CONFIG = get_preset("tiny_deepseek_v3", rope_interleaved=False)


@pytest.fixture(scope="module")
def model():
  return random_model(CONFIG, seed=3)


def test_the_cache_holds_the_latent_and_the_rope_key_not_keys_and_values():
  cache = KVCache.zeros(CONFIG, batch=2, length=9)
  assert cache.k_NxBxSxKxH.shape == (2, 2, 9, 1, 32)  # kv_lora_rank
  assert cache.v_NxBxSxKxH.shape == (2, 2, 9, 1, 8)  # qk_rope_head_dim
  # DeepSeek V3 in bf16: 61 layers x (512 + 64) x 2 bytes per token, where expanded keys and
  # values would take 61 x 128 heads x (192 + 128) x 2 (71x more).
  v3 = get_preset("deepseek-v3")
  assert kv_cache_bytes_per_token(v3) == 61 * (512 + 64) * 2 == 70_272
  expanded = get_preset("deepseek-v3", kv_lora_rank=0, q_lora_rank=0, qk_rope_head_dim=0,
                        v_head_dim=0, rope_interleaved=False, head_dim=192)
  assert kv_cache_bytes_per_token(expanded) == 61 * 128 * 192 * 2 * 2


@pytest.mark.parametrize("scan", [False, True])
def test_cached_greedy_in_the_latent_equals_the_expanded_recomputation(model, scan):
  if scan:  # the layers' latents ride in the scan's carry (attention/cache_slot.py); scanned
    # layers must all have experts
    model = random_model(CONFIG.replace(moe_layers=(0, 1), scan_layers=True), seed=3)
  steps = 6
  got = generate(model, PROMPTS, LENGTHS, max_new_tokens=steps)
  want, _ = _uncached_greedy(model, PROMPTS, LENGTHS, steps)
  np.testing.assert_array_equal(np.asarray(got.tokens_BxT), want)


def test_both_orders_give_the_same_attention_probabilities(model):
  tokens = jnp.asarray(PROMPTS[:1], jnp.int32)
  expanded = forward(model, tokens, return_attention=True).attention_probs
  cache = KVCache.zeros(CONFIG, 1, tokens.shape[1])
  absorbed = forward(model, tokens, cache=cache, return_attention=True).attention_probs
  assert expanded.shape == absorbed.shape == (2, 1, 4, 6, 6)
  np.testing.assert_allclose(expanded, absorbed, atol=1e-6)


def test_blockwise_with_padded_values_equals_the_reference_in_values_and_gradients(model):
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 13)), jnp.int32)

  def loss_and_grads(impl):
    graphdef, state = nnx.split(with_config(model, attention_impl=impl))
    fn = lambda s: jnp.sum(nnx.merge(graphdef, s)(tokens).logits_BxLxV ** 2) * 1e-3
    return jax.jit(jax.value_and_grad(fn))(state)

  (v_ref, g_ref), (v_blk, g_blk) = loss_and_grads("reference"), loss_and_grads("blockwise")
  np.testing.assert_allclose(v_ref, v_blk, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_blk)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_latent_attention_flops_by_hand():
  got = flops.latent_attention_flops(CONFIG, batch=1, seq_len=4)
  D, H, R, Rq, Dr, Dn, Dv, N = 64, 4, 32, 48, 8, 16, 16, 2
  tokens = 4
  q = D * Rq + Rq * H * (Dn + Dr)
  kv = D * (R + Dr) + R * H * (Dn + Dv)
  assert got["qkv_proj"] == 2 * tokens * N * (q + kv)
  assert got["out_proj"] == 2 * tokens * N * H * Dv * D
  assert got["attn_scores"] == 2 * N * H * (Dn + Dr) * 4 * 4 / 2  # causal pairs: L^2 / 2
  assert got["attn_values"] == 2 * N * H * Dv * 4 * 4 / 2


@pytest.mark.parametrize("change,message", [
    (dict(sliding_window=8), "model.sliding_window=8 cannot be combined with "
                             "model.kv_lora_rank=32 (DeepSeek's latent attention); set "
                             "sliding_window=None"),
    (dict(qkv_bias=True), "model.qkv_bias=True cannot be combined with model.kv_lora_rank=32"),
    (dict(qk_rope_head_dim=24), "model.qk_rope_head_dim=24 must be even, positive and below "
                                "model.head_dim=24"),
    (dict(kv_lora_rank=0), "model.q_lora_rank=48 is part of latent attention (DeepSeek's MLA), "
                           "but model.kv_lora_rank=0"),
    (dict(rope_scaling_factor=None), "model.rope_yarn_mscale=1.0 is part of YaRN RoPE"),
])
def test_latent_attention_config_errors_are_one_line(change, message):
  with pytest.raises(ConfigError) as raised:
    CONFIG.replace(**change)
  assert message in str(raised.value) and "\n" not in str(raised.value)
