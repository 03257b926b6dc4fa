"""Qwen3.5's hybrid decoder in distillax (tiny_qwen35: three Gated DeltaNet layers, one gated
full-attention layer with partial RoPE): the chunked layers against the recurrent reference,
cached decode against the full forward, packed documents against each document alone, the
sampler over left-padded prompts, and the config's refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.errors import ConfigError
from distillax.models.attention.layer import KVCache
from distillax.models.layers import apply_rope
from distillax.models.presets import get_preset
from distillax.models.sampler import generate
from distillax.models.transformer import with_config
from tests.support.models import NORMS_NEAR_ONE, random_model

CONFIG = get_preset("tiny_qwen35", vocab_size=64, linear_attention_chunk=4)
L = 11


@pytest.fixture(scope="module")
def model():
  return random_model(CONFIG, seed=0, init=NORMS_NEAR_ONE)


@pytest.fixture(scope="module")
def tokens():
  return jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, L)), jnp.int32)


_logits = jax.jit(lambda m, t, seg=None, pos=None: m(t, segment_ids_BxL=seg,
                                                      positions_BxL=pos).logits_BxLxV)


@jax.jit
def _cached_step(m, t, cache):
  out = m(t, cache=cache)
  return out.logits_BxLxV, out.cache


def test_chunked_layers_equal_the_recurrent_reference(model, tokens):
  chunked = _logits(model, tokens)
  recurrent = _logits(with_config(model, linear_attention_impl="recurrent"), tokens)
  assert float(jnp.abs(chunked).max()) > 1.0
  np.testing.assert_allclose(chunked, recurrent, atol=1e-4)


def test_cached_decode_equals_the_full_forward(model, tokens):
  """A 7-token prefill, then one token at a time: the conv and delta-rule states carried in
  the cache give the full forward's logits."""
  full = _logits(model, tokens)
  cache = KVCache.zeros(CONFIG, 2, L)
  assert cache.k_NxBxSxKxH.shape[0] == 1 and cache.state_NxBxHxKxV.shape[0] == 3
  step_logits, cache = _cached_step(model, tokens[:, :7], cache)
  pieces = [step_logits]
  for t in range(7, L):
    step_logits, cache = _cached_step(model, tokens[:, t:t + 1], cache)
    pieces.append(step_logits)
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-4)


def test_packed_documents_equal_each_document_alone(model, tokens):
  """The second document (starting mid-chunk) sees nothing of the first: its logits are those
  of it run alone (right-padded to the same length, so the same program runs)."""
  cut = 5
  seg = jnp.asarray([[1] * cut + [2] * (L - cut)] * 2, jnp.int32)
  pos = jnp.asarray([list(range(cut)) + list(range(L - cut))] * 2, jnp.int32)
  packed = _logits(model, tokens, seg, pos)
  alone = _logits(model, jnp.roll(tokens, -cut, axis=1))[:, :L - cut]
  np.testing.assert_allclose(packed[:, cut:], alone, atol=1e-4)
  np.testing.assert_allclose(packed[:, :cut], _logits(model, tokens)[:, :cut], atol=1e-4)


def test_sampler_over_left_padded_prompts_matches_greedy_full_forwards(model, tokens):
  """Greedy generation of a batch whose prompts differ in length (so the shorter is padded,
  segment 0, ahead of it in the cache) equals argmax decoding each prompt alone by full
  forwards (causal: what follows position n - 1 in the array does not change its logits)."""
  lengths, new = np.array([6, 4]), 3
  out = generate(model, tokens[:, :6], jnp.asarray(lengths), max_new_tokens=new)
  seqs = np.array(tokens)
  rows = np.arange(2)
  for step in range(new):
    logits = np.asarray(_logits(model, jnp.asarray(seqs)))
    seqs[rows, lengths + step] = logits[rows, lengths + step - 1].argmax(-1)
  np.testing.assert_array_equal(out.tokens_BxT, seqs[rows[:, None], lengths[:, None] +
                                                     np.arange(new)])


def test_partial_rope_turns_only_the_leading_features():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(1, 3, 2, 8)), jnp.float32)
  angles = jnp.asarray(rng.normal(size=(1, 3, 2)), jnp.float32)  # 2 pairs: 4 of 8 features
  out = np.asarray(apply_rope(x, jnp.sin(angles), jnp.cos(angles)))
  xn, a = np.asarray(x), np.asarray(angles)[:, :, None, :]
  x1, x2 = xn[..., :2], xn[..., 2:4]  # rotate_half over the first four features
  np.testing.assert_allclose(out[..., :2], x1 * np.cos(a) - x2 * np.sin(a), atol=1e-6)
  np.testing.assert_allclose(out[..., 2:4], x2 * np.cos(a) + x1 * np.sin(a), atol=1e-6)
  np.testing.assert_array_equal(out[..., 4:], xn[..., 4:])


@pytest.mark.parametrize("change,message", [
    ({"token_mixers": ("linear_attention",) * 3}, "model.token_mixers="),
    ({"token_mixers": ("linear_attention",) * 3 + ("sliding_attention",)}, "model.token_mixers="),
    ({"linear_num_value_heads": 3}, "model.linear_num_value_heads=3"),
    ({"linear_attention_impl": "fast"}, "model.linear_attention_impl='fast'"),
    ({"partial_rotary_factor": 0.1}, "model.partial_rotary_factor=0.1"),
    ({"scan_layers": True}, "model.scan_layers=True"),
])
def test_config_refuses_with_the_field_and_value(change, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    CONFIG.replace(**change)


def test_the_command_line_can_name_the_token_mixers():
  """The model section types token_mixers as a tuple (a None field cannot be overridden by
  `--config.model.token_mixers=...`)."""
  from distillax.configs.common import model_config
  section = model_config("tiny")
  assert section.get_type("token_mixers") is tuple and section.token_mixers is None
  section.token_mixers = ("linear_attention", "full_attention")
  assert get_preset("tiny", token_mixers=section.token_mixers).num_linear_layers == 1


def test_attention_probabilities_of_a_hybrid_model_are_refused_in_one_line(model, tokens):
  with pytest.raises(ConfigError, match="Gated DeltaNet layers"):
    model(tokens, return_attention=True)
