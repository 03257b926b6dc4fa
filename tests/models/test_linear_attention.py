"""Gated DeltaNet math (models/linear_attention.py): the chunked training form against the
token-by-token recurrent form in values and gradients (packed documents, lengths on and off the
chunk grid), both against a numpy transcription of the recurrence, and the causal conv against
numpy, with and without a carried state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.models import linear_attention as la

B, H, K, V = 2, 2, 4, 3


def _inputs(L, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, L, H, K)) * K ** -0.5
  k = rng.normal(size=(B, L, H, K))
  k = k / np.sqrt((k * k).sum(-1, keepdims=True))
  v = rng.normal(size=(B, L, H, V))
  g = -np.abs(rng.normal(size=(B, L, H))) * 0.7
  beta = 1 / (1 + np.exp(-rng.normal(size=(B, L, H))))
  return [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)]


def _numpy_recurrence(q, k, v, g, beta, seg, state=None, state_segment=None):
  """The gated delta rule written out token by token in float64, as the Qwen3.5 paper states it."""
  q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
  out = np.zeros(v.shape)
  finals = []
  for b in range(q.shape[0]):
    S = np.zeros((H, K, V)) if state is None else np.asarray(state[b], np.float64)
    prev = None if state_segment is None else state_segment[b]
    for t in range(q.shape[1]):
      if prev is not None and seg[b, t] != prev:
        S = np.zeros((H, K, V))
      prev = seg[b, t]
      for h in range(H):
        S[h] *= np.exp(g[b, t, h])
        delta = beta[b, t, h] * (v[b, t, h] - S[h].T @ k[b, t, h])
        S[h] += np.outer(k[b, t, h], delta)
        out[b, t, h] = S[h].T @ q[b, t, h]
    finals.append(S)
  return out, np.stack(finals)


# (length, chunk, segment ids of the two rows): documents start inside chunks, exactly at chunk
# boundaries, and the length is or is not a multiple of the chunk.
CASES = {
    "boundaries_inside_chunks_ragged_length": (
        13, 5, [[1] * 3 + [2] * 6 + [3] * 4, [1] * 7 + [2] * 5 + [0]]),
    "documents_start_at_chunk_boundaries": (
        12, 4, [[1] * 4 + [2] * 4 + [3] * 4, [1] * 8 + [2] * 4]),
    "one_document_longer_than_chunks": (9, 4, [[1] * 9, [1] * 9]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_equals_recurrent_in_values_and_gradients(case):
  L, chunk, seg = CASES[case]
  seg = jnp.asarray(seg, jnp.int32)
  inputs = _inputs(L)
  rng = np.random.default_rng(1)
  ct_out = jnp.asarray(rng.normal(size=(B, L, H, V)), jnp.float32)
  ct_state = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  state0 = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  # Row 0's incoming state continues its first document; row 1's belongs to another one.
  state_segment = jnp.asarray([1, 5], jnp.int32)

  def loss(form, *arrays):
    *xs, s0 = arrays
    out, state = form(*xs, segment_ids_BxL=seg, initial_state_BxHxKxV=s0,
                      state_segment_B=state_segment)
    return jnp.sum(out * ct_out) + jnp.sum(state * ct_state), (out, state)

  chunked = lambda *xs, **kw: la.gated_delta_rule_chunked(*xs, **kw, chunk_size=chunk)
  results = {}
  for name, form in (("chunked", chunked), ("recurrent", la.gated_delta_rule_recurrent)):
    grad_fn = jax.jit(jax.grad(lambda *a, form=form: loss(form, *a), argnums=range(6),
                               has_aux=True))
    results[name] = grad_fn(*inputs, state0)
  (grads_c, (out_c, state_c)) = results["chunked"]
  (grads_r, (out_r, state_r)) = results["recurrent"]
  np.testing.assert_allclose(out_c, out_r, atol=1e-5)
  np.testing.assert_allclose(state_c, state_r, atol=1e-5)
  for name, gc, gr in zip(("q", "k", "v", "g", "beta", "state0"), grads_c, grads_r):
    assert np.abs(np.asarray(gr)).max() > 1e-3, name  # every input reaches the loss
    np.testing.assert_allclose(gc, gr, atol=1e-5, err_msg=name)
  want_out, want_state = _numpy_recurrence(*inputs, np.asarray(seg), np.asarray(state0),
                                           np.asarray(state_segment))
  np.testing.assert_allclose(out_r, want_out, atol=1e-5)
  np.testing.assert_allclose(state_r, want_state, atol=1e-5)


def test_a_document_ignores_everything_before_it():
  """Packed: the second document's outputs equal those of that document run alone."""
  L, cut = 11, 4
  q, k, v, g, beta = _inputs(L, seed=3)
  seg = jnp.asarray([[1] * cut + [2] * (L - cut)] * B, jnp.int32)
  chunked = jax.jit(la.gated_delta_rule_chunked, static_argnames="chunk_size")
  packed, _ = chunked(q, k, v, g, beta, segment_ids_BxL=seg, chunk_size=3)
  alone, _ = chunked(*(a[:, cut:] for a in (q, k, v, g, beta)), chunk_size=3)
  np.testing.assert_allclose(packed[:, cut:], alone, atol=1e-6)


def test_decode_continues_the_chunked_prefill():
  """Chunked over a prompt, then the recurrent form one token at a time from its state: the
  outputs of a full chunked pass."""
  L, prompt = 10, 7
  xs = _inputs(L, seed=4)
  seg = jnp.ones((B, L), jnp.int32)
  chunked = jax.jit(la.gated_delta_rule_chunked, static_argnames="chunk_size")
  full, _ = chunked(*xs, segment_ids_BxL=seg, chunk_size=4)
  _, state = chunked(*(a[:, :prompt] for a in xs), segment_ids_BxL=seg[:, :prompt], chunk_size=4)
  recurrent = jax.jit(la.gated_delta_rule_recurrent)
  for t in range(prompt, L):
    out, state = recurrent(
        *(a[:, t:t + 1] for a in xs), segment_ids_BxL=seg[:, t:t + 1],
        initial_state_BxHxKxV=state, state_segment_B=seg[:, t - 1])
    np.testing.assert_allclose(out[:, 0], full[:, t], atol=1e-5)


def _numpy_conv(x, w, seg):
  """y[t] = sum_j w[j] x[t - (K-1) + j] over taps of the same document."""
  Kc = w.shape[0]
  y = np.zeros(x.shape)
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      for j in range(Kc):
        s = t - (Kc - 1) + j
        if s >= 0 and all(seg[b, u] == seg[b, t] for u in range(s, t + 1)):
          y[b, t] += w[j] * x[b, s]
  return y


def test_causal_conv_against_numpy_with_and_without_a_carried_state():
  rng = np.random.default_rng(5)
  L, C, Kc = 9, 5, 4
  x = rng.normal(size=(B, L, C)).astype(np.float32)
  w = rng.normal(size=(Kc, C)).astype(np.float32)
  seg = np.array([[1] * 2 + [2] * 7, [1] * 6 + [2] * 3], np.int32)
  conv = jax.jit(la.causal_conv)
  y, _ = conv(jnp.asarray(x), jnp.asarray(w), segment_ids_BxL=jnp.asarray(seg))
  np.testing.assert_allclose(y, _numpy_conv(x, w, seg), atol=1e-5)
  # Two calls, the second from the first's state: the same as one call over everything.
  cut = 5
  _, (state, state_seg) = conv(jnp.asarray(x[:, :cut]), jnp.asarray(w),
                               segment_ids_BxL=jnp.asarray(seg[:, :cut]))
  y2, _ = conv(jnp.asarray(x[:, cut:]), jnp.asarray(w),
                         segment_ids_BxL=jnp.asarray(seg[:, cut:]), state_BxPxC=state,
                         state_segments_BxP=state_seg)
  np.testing.assert_allclose(y2, _numpy_conv(x, w, seg)[:, cut:], atol=1e-5)


def test_gated_rms_norm_and_l2_normalize_against_numpy():
  rng = np.random.default_rng(6)
  x, gate = rng.normal(size=(3, V)), rng.normal(size=(3, V))
  scale = rng.normal(size=(V,))
  want = scale * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * gate / (1 + np.exp(-gate))
  got = la.gated_rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(gate, jnp.float32),
                          jnp.asarray(scale, jnp.float32), 1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(la.l2_normalize(jnp.asarray(x, jnp.float32)),
                             x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6), rtol=1e-5)
