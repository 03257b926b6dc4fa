"""A top-k cache that keeps every id (K = V) read by CachedLogitKD over vocabulary slices: its
log-probs scattered once into vocabulary order as a table of the teacher's logits
(framework/slice_teachers.Table). The loss, every sum (each divergence; an eval's teacher_ce
and top1_agreement from the cache) and every student gradient against the chunk engine, which
reads the cache's K pairs in the cache's own order."""

import jax
import jax.numpy as jnp
import pytest

from distillax.distill import TEACHER_NLL, TOPK_IDS, TOPK_LOGPROBS, CachedLogitKD
from distillax.distill import make_distill_objective
from distillax.framework import token_loss_impl, vocab_slices
from tests.distill import helpers as h
from tests.distill.test_multi_teacher import _assert_same, _value_and_grads


@pytest.fixture(scope="module")
def whole_cache():
  """(student, a batch of 36 token rows carrying the teacher's every log-prob at T = 2 in the
  cache's order, largest first, and its NLL)."""
  student, teacher = h.make_models(0)
  batch = h.to_jnp(h.make_batch(B=4, L=9))
  t = teacher(batch["inputs_BxL"], positions_BxL=batch["positions_BxL"],
              segment_ids_BxL=batch["segment_ids_BxL"]).logits_BxLxV
  logp, ids = jax.lax.top_k(jax.nn.log_softmax(t / 2.0, -1), h.VOCAB)
  nll = -jnp.take_along_axis(jax.nn.log_softmax(t, -1), batch["targets_BxL"][..., None], -1)
  assert ids.shape[-1] == h.VOCAB and bool(jnp.any(ids[..., 0] != 0))
  return student, {**batch, TOPK_IDS: ids, TOPK_LOGPROBS: logp, TEACHER_NLL: nll[..., 0]}


@pytest.mark.parametrize("metrics", [False, True])
@pytest.mark.parametrize("divergence,alpha", [("forward_kl", 0.7), ("reverse_kl", 0.4),
                                              ("jsd", 1.0)])
def test_a_whole_cache_over_slices_equals_the_chunk_engine(whole_cache, divergence, alpha,
                                                           metrics, monkeypatch):
  """Slices of 20 of the 48 columns (the last shifted back): loss, every sum and every
  gradient within 1e-5 of the chunk engine's, and what ran was the slices."""
  student, batch = whole_cache
  monkeypatch.setattr(vocab_slices, "slice_size_for", lambda tokens, vocab, requested=0: 20)
  kd = CachedLogitKD(temperature=2.0, alpha=alpha, divergence=divergence, beta=0.3)
  want = _value_and_grads(make_distill_objective(kd, chunk_size=4, metrics=metrics), student,
                          {}, batch)
  with token_loss_impl.recorded_choices() as ran:
    got = _value_and_grads(make_distill_objective(kd, sliced=True, metrics=metrics), student,
                           {}, batch)
  assert [k.split(" (")[0] for k in ran] == ["sliced"]
  assert ("top1_agreement" in got[0].sums) == metrics and "logit_cosine" not in got[0].sums
  _assert_same(got, want)


def test_a_whole_cache_over_a_padded_vocabulary_equals_whole_logits():
  """Traced over 40 token rows of the 48, the cache written as a recipe writes it (the teacher's
  padded rows masked before its softmax, so they come last in the cache): a reverse KL over
  the slices, which leave the padded columns out, equals the whole-logits objective's over
  the cache's 48 pairs, loss, sums and gradients, and the padded rows get no gradient."""
  from distillax.framework import token_rows
  student, teacher = h.make_models(0)
  batch = h.to_jnp(h.make_batch(B=4, L=9, vocab=40))  # targets among the token rows
  t = token_rows.masked(teacher(batch["inputs_BxL"], positions_BxL=batch["positions_BxL"],
                                segment_ids_BxL=batch["segment_ids_BxL"]).logits_BxLxV, 40)
  logp, ids = jax.lax.top_k(jax.nn.log_softmax(t / 2.0, -1), h.VOCAB)
  assert bool(jnp.all(ids[..., 40:] >= 40))
  cached = {**batch, TOPK_IDS: ids, TOPK_LOGPROBS: logp}
  kd = CachedLogitKD(temperature=2.0, alpha=0.6, divergence="reverse_kl")
  over_rows = lambda objective: token_rows.over_token_rows(objective, 40)
  want = _value_and_grads(over_rows(make_distill_objective(kd, chunk_size=None)), student, {},
                          cached)
  with token_loss_impl.recorded_choices() as ran:
    got = _value_and_grads(over_rows(make_distill_objective(kd, sliced=True)), student, {},
                           cached)
  assert [k.split(" (")[0] for k in ran] == ["sliced"]
  _assert_same(got, want)
  head = got[1]["lm_head"] if "lm_head" in got[1] else got[1]["embedder"]["embedding"].T
  assert bool(jnp.all(head[:, 40:] == 0)) and bool(jnp.any(head[:, :40] != 0))
