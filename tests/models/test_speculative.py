"""Speculative decoding against the target's own decoding: greedy token for token (an EAGLE-3
head and a whole small model as drafts), sampled in distribution, and the head's cached decode
against its training-time-test forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.models.eagle3 import Eagle3Config, aux_features
from distillax.models.presets import get_preset
from distillax.models.sampler import SamplingConfig, generate
from distillax.models.speculative import HeadDraft, ModelDraft, speculative_decode
from distillax import partitioning as pt
from distillax.trainers.draft import created_head
from tests.support.models import Normal, logits, random_model

TARGET = get_preset("tiny", vocab_size=64, num_layers=2)
PROMPTS = np.array([[5, 9, 11, 3, 7, 2], [8, 1, 4, 0, 0, 0], [30, 31, 0, 0, 0, 0]], np.int32)
LENGTHS = np.array([6, 3, 2], np.int32)


@pytest.fixture(scope="module")
def target():
  return random_model(TARGET, seed=1, init=Normal(0.3))


def _head(target, draft_ids, seed=0):
  """A random head started from `target` as the draft recipe starts it (one compiled program,
  on one device)."""
  config = Eagle3Config.for_target(target.config, (), len(draft_ids))
  mesh = pt.create_mesh({"data": 1, "model": 1}, devices=jax.devices()[:1])
  return created_head(config, target, np.asarray(draft_ids, np.int32), mesh,
                      pt.rules_from_config({"strategy": "dp"}), seed)


def _decode(target, draft, cfg, k, prompts, lengths, seed=0):
  keys = jax.random.split(jax.random.key(seed), len(prompts))
  run = jax.jit(lambda p, n, key: speculative_decode(target, draft, p, n, key, cfg, k))
  return run(jnp.asarray(prompts), jnp.asarray(lengths), keys)


@pytest.mark.parametrize("kind", ["head", "model"])
def test_greedy_speculative_decoding_equals_the_targets_greedy_decode(target, kind):
  steps, k = 10, 2
  want = np.asarray(generate(target, PROMPTS, LENGTHS, max_new_tokens=steps,
                             vocab_limit=60).tokens_BxT)
  draft = {"head": lambda: HeadDraft(_head(target, np.arange(0, 48))),
           "model": lambda: ModelDraft(random_model(TARGET.replace(num_layers=1), seed=5))}[kind]()
  out = _decode(target, draft, SamplingConfig(steps, vocab_limit=60), k, PROMPTS, LENGTHS)
  np.testing.assert_array_equal(np.asarray(out.tokens_BxT), want)
  rounds, accepted = np.asarray(out.rounds_B), np.asarray(out.accepted_B)
  # Every round's tokens are counted: the first from the prefill, then n + 1 per round.
  assert np.all(1 + accepted + rounds >= steps) and np.all(accepted + rounds < steps + k)


def _exact_marginals(target, prompt, vocab):
  """The target's own distribution of the 2nd and 3rd sampled token (temperature 1), summed
  exactly over the earlier tokens from full forwards."""
  P = len(prompt)
  p0 = jax.nn.softmax(np.asarray(logits(target, prompt[None]))[0, -1, :vocab])
  one = np.concatenate([np.tile(prompt, (vocab, 1)), np.arange(vocab)[:, None]], 1)
  p1 = jax.nn.softmax(np.asarray(logits(target, one))[:, P, :vocab])  # [a, b]
  two = np.concatenate([np.repeat(one, vocab, 0), np.tile(np.arange(vocab), vocab)[:, None]], 1)
  p2 = jax.nn.softmax(np.asarray(logits(target, two))[:, P + 1, :vocab]).reshape(
      vocab, vocab, vocab)  # [a, b, c]
  joint_ab = np.asarray(p0)[:, None] * np.asarray(p1)
  return joint_ab.sum(0), (joint_ab[:, :, None] * np.asarray(p2)).sum((0, 1))


def test_sampled_speculative_tokens_follow_the_targets_distribution():
  """Rows sample the 2nd and 3rd token through the rejection rule (the 1st comes from the
  prefill). Their empirical marginals over N = 4000 independent rows are held to the exact ones
  within total variation 0.075. Why that bound: for N draws from a V-category distribution
  E[TV] <= 0.5 * sqrt(V / N) = 0.032 (V = 16), and TV moves by at most 1/N per draw, so by
  McDiarmid P(TV > E[TV] + 0.043) <= exp(-2 N 0.043^2) < 1e-6: a correct sampler fails it with
  probability below one in a million (and the seed is fixed). The draft (a random head over 12 of
  the 16 ids) is far from the target: its own proposals, accepted blindly, miss the bound
  (asserted), so the test sees a wrong acceptance rule."""
  vocab, n = 16, 4000
  target = random_model(get_preset("tiny", vocab_size=vocab, num_layers=2), seed=2,
                        init=Normal(0.25))
  head = _head(target, np.arange(2, 14))
  prompt = np.array([3, 7, 1], np.int32)
  want1, want2 = _exact_marginals(target, prompt, vocab)
  cfg = SamplingConfig(3, temperature=1.0)
  prompts, lengths = np.tile(prompt, (n, 1)), np.full((n,), 3, np.int32)
  out = _decode(target, HeadDraft(head), cfg, 2, prompts, lengths, seed=11)
  tokens = np.asarray(out.tokens_BxT)
  tv = lambda col, want: 0.5 * np.abs(np.bincount(tokens[:, col], minlength=vocab) / n
                                      - want).sum()
  assert tv(1, want1) < 0.075, tv(1, want1)
  assert tv(2, want2) < 0.075, tv(2, want2)
  assert np.asarray(out.accepted_B).sum() > 0.1 * n  # the rule did accept draft tokens
  # Blind acceptance (every proposal kept) would give the draft's own distribution: far off.
  h_keys = jax.random.split(jax.random.key(5), n)
  first = np.asarray(out.tokens_BxT)[:, 0]
  q = _head_first_proposals(target, head, prompt, first, h_keys)
  assert 0.5 * np.abs(np.bincount(q, minlength=vocab) / n - want1).sum() > 0.15


def _head_first_proposals(target, head, prompt, first_N, keys):
  """The head's own draw of the 2nd token after each row's 1st (temperature 1)."""
  P = len(prompt)
  rows = np.concatenate([np.tile(prompt, (len(first_N), 1)), first_N[:, None]], 1)

  @jax.jit
  def draw(rows, keys):
    out = target(rows, return_hidden_states=True)
    aux = aux_features(out.hidden_states, head.config.aux_layers)
    N = rows.shape[0]
    hidden = head.ttt_hidden(aux[:, :P], rows[None, :, 1:], jnp.broadcast_to(jnp.arange(P), (N, P)),
                             jnp.ones((N, P), jnp.int32))
    draws = jax.vmap(jax.random.categorical)(keys, head.logits(hidden[0])[:, -1])
    return head.d2t[...][draws]

  return np.asarray(draw(jnp.asarray(rows), keys))


def test_the_heads_cached_decode_equals_its_training_time_test_forward(target):
  """TTT step j at position t is what the head computes at inference j tokens past t: the same
  hidden states from the training forward and from the decode cache (extend)."""
  head = _head(target, np.arange(64))
  tokens = jnp.asarray([[5, 9, 11, 3, 7, 2, 40, 41, 42, 43, 44]], jnp.int32)
  L, T, t = 8, 3, 4  # positions 0..7; the cache takes prefix 0..t, then two of its own steps

  @jax.jit
  def both(tokens):
    out = target(tokens, return_hidden_states=True)
    aux = aux_features(out.hidden_states, head.config.aux_layers)
    steps = jnp.stack([tokens[:, 1 + j:1 + j + L] for j in range(T)])
    ttt = head.ttt_hidden(aux[:, :L], steps, jnp.arange(L)[None], jnp.ones((1, L), jnp.int32))
    cache = head.cache_zeros(1, 16)
    h, cache = head.extend(cache, 0, tokens[:, 1:t + 2], head.fuse(aux[:, :t + 1]))
    h1, cache = head.extend(cache, t + 1, tokens[:, t + 2:t + 3], h[:, t:t + 1])
    h2, _ = head.extend(cache, t + 2, tokens[:, t + 3:t + 4], h1)
    return ttt, h, h1, h2

  ttt, h, h1, h2 = both(tokens)
  np.testing.assert_allclose(h[0], ttt[0, 0, :t + 1], atol=2e-5)
  np.testing.assert_allclose(h1[0, 0], ttt[1, 0, t], atol=2e-5)
  np.testing.assert_allclose(h2[0, 0], ttt[2, 0, t], atol=2e-5)
