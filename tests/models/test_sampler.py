"""KV-cached generation against uncached recomputation, sharded and unsharded, and sampling
filters against the distributions they should draw from."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import partitioning as pt
from distillax.errors import UserError
from distillax.models.presets import get_preset
from distillax.models.init import model_shardings
from distillax.models.sampler import (Sampler, SamplingConfig, filter_logits, generate,
                                      sample_token)
from distillax.models.transformer import with_layer_layout
from tests.support.models import Normal, forward, random_model

PROMPTS = np.array([[7, 3, 9, 200, 11, 5],
                    [42, 17, 0, 0, 0, 0],
                    [1, 2, 3, 4, 0, 0]], np.int32)
LENGTHS = np.array([6, 2, 4], np.int32)


def _uncached_greedy(model, prompts, lengths, steps):
  """Re-runs the full (cache-free) forward over the whole text for every new token."""
  B = len(prompts)
  buf = np.zeros((B, prompts.shape[1] + steps), np.int32)
  for b in range(B):
    buf[b, :lengths[b]] = prompts[b, :lengths[b]]
  cur = lengths.copy()
  out = []
  for _ in range(steps):
    seg = (np.arange(buf.shape[1])[None] < cur[:, None]).astype(np.int32)  # unfilled = padding
    logits = np.asarray(forward(model, jnp.asarray(buf), segment_ids_BxL=jnp.asarray(seg))
                        .logits_BxLxV)
    nxt = logits[np.arange(B), cur - 1].argmax(-1)
    buf[np.arange(B), cur] = nxt
    cur = cur + 1
    out.append(nxt)
  return np.stack(out, 1), buf


@pytest.mark.parametrize("name,scan,overrides", [
    ("tiny", False, {}),
    ("tiny_gemma", True, {}),
    # Qwen 2 biases + Qwen 3 q/k norms (cached keys are biased, normed, then rotated) and a
    # Mistral-style window of 5 on every layer, shorter than prompt + generation.
    ("tiny", True, dict(qkv_bias=True, qk_norm=True, sliding_window=5, sliding_window_pattern=0)),
    # A mixture of experts: each decoded token is routed on its own (ragged groups of 3 rows).
    ("tiny_moe", True, {}),
])
def test_cached_greedy_equals_uncached_recomputation(name, scan, overrides):
  # tiny_gemma: the sliding window (8) is shorter than prompt + generation, soft-caps on.
  model = with_layer_layout(random_model(get_preset(name, **overrides), seed=3), scan)
  steps = 7
  got = generate(model, PROMPTS, LENGTHS, max_new_tokens=steps)
  want, _ = _uncached_greedy(model, PROMPTS, LENGTHS, steps)
  np.testing.assert_array_equal(np.asarray(got.tokens_BxT), want)
  np.testing.assert_array_equal(np.asarray(got.lengths_B), steps)
  assert np.all(np.asarray(got.logprobs_BxT) < 0)


def test_sharded_model_generates_the_same_tokens():
  model = random_model(get_preset("tiny"), seed=4)
  prompts = np.tile(PROMPTS, (3, 1))[:8]
  lengths = np.tile(LENGTHS, 3)[:8]
  plain = generate(model, prompts, lengths, max_new_tokens=5)
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rules = pt.rules_from_config({"strategy": "fsdp_tp"})
  shardings = model_shardings(model, mesh, rules)
  graphdef, state = nnx.split(model)
  placed = nnx.merge(graphdef, jax.tree.map(lambda x, s: jax.device_put(x, s),
                                            nnx.to_pure_dict(state), shardings))
  assert placed.layers[0].mlp.up[...].addressable_shards[0].data.shape == (16, 64)
  sharded = generate(placed, prompts, lengths, max_new_tokens=5, mesh=mesh, rules=rules)
  np.testing.assert_array_equal(np.asarray(sharded.tokens_BxT), np.asarray(plain.tokens_BxT))


def test_top_k_1_is_greedy_and_eos_stops_rows():
  model = random_model(get_preset("tiny"), seed=5)
  sampler = Sampler(model)
  greedy = np.asarray(sampler(PROMPTS, LENGTHS, max_new_tokens=6).tokens_BxT)
  got = sampler(PROMPTS, LENGTHS, max_new_tokens=6, seed=9, temperature=2.0, top_k=1)
  np.testing.assert_array_equal(np.asarray(got.tokens_BxT), greedy)
  eos = int(greedy[0, 2])  # row 0 stops at step 2; other rows stop where they meet it, if ever
  out = sampler(PROMPTS, LENGTHS, max_new_tokens=6, eos_id=eos, pad_id=255)
  tokens, lengths = np.asarray(out.tokens_BxT), np.asarray(out.lengths_B)
  for b in range(len(PROMPTS)):
    hits = np.flatnonzero(greedy[b] == eos)
    stop = hits[0] + 1 if len(hits) else 6
    assert lengths[b] == stop
    np.testing.assert_array_equal(tokens[b, :stop], greedy[b, :stop])
    assert np.all(tokens[b, stop:] == 255)
    assert np.all(np.asarray(out.logprobs_BxT)[b, stop:] == 0)


def test_sampled_tokens_respect_top_k_and_follow_the_distribution():
  model = random_model(get_preset("tiny"), seed=6, init=Normal(0.15))
  model.lm_head[...] = model.lm_head[...] * 8.0  # sharpen: top tokens ~0.13, 0.10, 0.10
  prompt = np.tile(np.array([[5, 6, 7, 8]], np.int32), (2000, 1))
  logits = np.asarray(forward(model, jnp.asarray(prompt[:1])).logits_BxLxV)[0, -1]
  probs = np.exp(logits - logits.max())
  probs /= probs.sum()
  sampler = Sampler(model)
  # Plain temperature-1 sampling: empirical frequencies of the likeliest tokens match softmax.
  first = np.asarray(sampler(prompt, max_new_tokens=1, temperature=1.0, seed=1).tokens_BxT)[:, 0]
  freq = np.bincount(first, minlength=256) / len(first)
  top = np.argsort(probs)[::-1][:5]
  assert probs[top[0]] > 0.1 and probs[top[2]] > 0.03  # a peaked distribution, so this can fail
  np.testing.assert_allclose(freq[top], probs[top], atol=0.035)
  # top-k = 3: only the three likeliest tokens, in proportions renormalised among them.
  first_k = np.asarray(sampler(prompt, max_new_tokens=1, temperature=1.0, top_k=3,
                               seed=2).tokens_BxT)[:, 0]
  top3 = np.argsort(probs)[::-1][:3]
  assert set(first_k) <= set(top3)
  renorm = probs[top3] / probs[top3].sum()
  np.testing.assert_allclose(np.bincount(first_k, minlength=256)[top3] / len(first_k), renorm,
                             atol=0.04)
  # top-p = 0.2: the nucleus is the two likeliest tokens (the first alone has < 0.2 mass).
  assert probs[top[0]] < 0.2 < probs[top[0]] + probs[top[1]]
  first_p = np.asarray(sampler(prompt, max_new_tokens=1, temperature=1.0, top_p=0.2,
                               seed=3).tokens_BxT)[:, 0]
  assert set(first_p) == set(top[:2])


def test_sampled_ids_from_a_padded_model_are_all_below_the_tokenizer_size():
  """The byte tokenizer's 259 ids in a vocabulary padded to 384 rows, as training pads it: of
  1,000 ids a fresh model samples, none is a padded row; without the limit, the same draws
  include padded rows (so the limit is what keeps them out)."""
  model = random_model(get_preset("tiny", vocab_size=384), seed=7)
  prompt = np.tile(np.array([[2, 103, 104]], np.int32), (8, 1))
  sampler = Sampler(model)
  ids = np.asarray(sampler(prompt, max_new_tokens=125, temperature=1.0, seed=0,
                           vocab_limit=259).tokens_BxT)
  assert ids.size == 1000 and ids.max() < 259
  assert len(set(ids.ravel().tolist())) > 100  # a spread of real tokens, not one id
  unlimited = np.asarray(sampler(prompt, max_new_tokens=125, temperature=1.0,
                                 seed=0).tokens_BxT)
  assert (unlimited >= 259).sum() > 100
  # Greedy, top-k and top-p pick among real ids even when a padded row scores highest.
  logits = jnp.zeros((1, 384)).at[0, 300].set(9.0).at[0, 5].set(4.0).at[0, 6].set(3.0)
  for cfg in (SamplingConfig(1, 0.0, vocab_limit=259), SamplingConfig(1, 1.0, top_k=1,
                                                                      vocab_limit=259),
              SamplingConfig(1, 1.0, top_p=0.01, vocab_limit=259)):
    assert int(sample_token(logits, jax.random.key(0), cfg)[0]) == 5, cfg


def test_filter_logits_top_p_keeps_the_smallest_nucleus():
  logits = jnp.log(jnp.array([[0.5, 0.05, 0.3, 0.15]]))
  kept = np.isfinite(np.asarray(filter_logits(logits, SamplingConfig(1, 1.0, top_p=0.75))))
  np.testing.assert_array_equal(kept[0], [True, False, True, False])  # 0.5 + 0.3 >= 0.75
  kept = np.isfinite(np.asarray(filter_logits(logits, SamplingConfig(1, 1.0, top_p=0.85))))
  np.testing.assert_array_equal(kept[0], [True, False, True, True])


def test_bad_sampling_arguments():
  model = random_model(get_preset("tiny"))
  with pytest.raises(UserError, match="top_p"):
    generate(model, PROMPTS, max_new_tokens=2, temperature=1.0, top_p=1.5)
  with pytest.raises(UserError, match="max_seq_len"):
    generate(model, PROMPTS, max_new_tokens=500)
  with pytest.raises(UserError, match="vocab_limit"):
    generate(model, PROMPTS, max_new_tokens=2, vocab_limit=0)
