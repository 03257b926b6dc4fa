"""Cross-tokenizer losses: ULD and the group terms against NumPy, and one tokenizer on both sides
against ordinary token-level KL."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.data.chat_testing import corpus_sentences
from tests.support.tokenizers import trained_bpe
from distillax.data.cross_tokenizer.alignment import EXACT, SKIP, SPAN, align_spans, alignment_targets
from distillax.data.cross_tokenizer.token_bytes import encode_with_byte_offsets, shared_vocab
from distillax.data.tokenizer import make_tokenizer
from distillax.distill.cross_tokenizer.losses import (AlignedTargets, cross_tokenizer_loss,
                                               cross_tokenizer_terms, per_group_terms,
                                               uld_distance)
from distillax.distill.divergences import kl


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _uld_numpy(p_s, p_t):
  V = max(p_s.shape[-1], p_t.shape[-1])
  s = np.sort(p_s, -1)[:, ::-1]
  t = np.sort(p_t, -1)[:, ::-1]
  s = np.pad(s, ((0, 0), (0, V - s.shape[-1])))
  t = np.pad(t, ((0, 0), (0, V - t.shape[-1])))
  return np.abs(s - t).sum(-1)


def test_uld_against_numpy():
  rng = np.random.default_rng(0)
  p_s = np.exp(_log_softmax(rng.normal(size=(5, 7)) * 2))
  p_t = np.exp(_log_softmax(rng.normal(size=(5, 11)) * 2))
  got = uld_distance(jnp.asarray(p_s, jnp.float32), jnp.asarray(p_t, jnp.float32))
  np.testing.assert_allclose(got, _uld_numpy(p_s, p_t), rtol=1e-5, atol=1e-6)
  # A permutation of a vocabulary is no change; the same distribution is distance 0.
  same = uld_distance(jnp.asarray(p_s[:, ::-1]), jnp.asarray(p_s))
  np.testing.assert_allclose(same, 0, atol=1e-7)


def _targets(ids):
  return np.append(np.asarray(ids[1:]), 0)


def test_group_terms_against_numpy():
  """Student <s> "a" "bc" </s> against teacher <s> "a" "b" "c" </s>, random logits."""
  alignment = align_spans(np.array([(0, 0), (0, 1), (1, 3), (3, 3)]),
                          np.array([(0, 0), (0, 1), (1, 2), (2, 3), (3, 3)]))
  s_ids, t_ids = [1, 3, 5, 2], [1, 3, 6, 7, 2]
  # Teacher ids 0-4 are student 0-4 (so "a", <s>, </s> are shared); 5-7 are the teacher's own.
  to_student = np.array([0, 1, 2, 3, 4, -1, -1, -1])
  shared_t = np.flatnonzero(to_student >= 0)
  shared_s = to_student[shared_t]
  aligned = alignment_targets(alignment, s_ids, t_ids, to_student)
  rng = np.random.default_rng(1)
  s_logits, t_logits = rng.normal(size=(1, 4, 6)) * 2, rng.normal(size=(1, 5, 8)) * 2
  targets = AlignedTargets(_targets(s_ids)[None], _targets(t_ids)[None],
                           aligned["student_group_N"][None], aligned["teacher_group_M"][None],
                           aligned["group_kind_G"][None])

  def loss(logits):  # one compile gives the terms and the student's gradient
    terms = cross_tokenizer_terms(logits, jnp.asarray(t_logits, jnp.float32), targets, shared_s,
                                  shared_t)
    return cross_tokenizer_loss(terms), terms

  (_, terms), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(
      jnp.asarray(s_logits, jnp.float32))
  ls, lt = _log_softmax(s_logits[0]), _log_softmax(t_logits[0])

  def bucket_kl(t_row, s_row):
    rest_t = np.log(np.exp(np.delete(t_row, shared_t)).sum())
    rest_s = np.log(np.exp(np.delete(s_row, shared_s)).sum())
    p = np.exp(t_row[shared_t])
    return (p * (t_row[shared_t] - s_row[shared_s])).sum() + np.exp(rest_t) * (rest_t - rest_s)

  # "a": teacher position 0 against student position 0; </s>: teacher 3 against student 2.
  exact = bucket_kl(lt[0], ls[0]) + bucket_kl(lt[3], ls[2])
  span_t, span_s = lt[1, 6] + lt[2, 7], ls[1, 5]
  p, q = np.exp(span_t), np.exp(span_s)
  span = p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))
  uld = _uld_numpy(np.exp(ls[1])[None], (np.exp(lt[1]) * np.exp(lt[2, 7]))[None])[0]
  np.testing.assert_allclose([terms.exact_kl, terms.span_kl, terms.uld], [exact, span, uld],
                             rtol=1e-5, atol=1e-6)
  assert (terms.exact_groups, terms.span_groups) == (2, 1)
  assert np.isfinite(grad).all() and np.abs(grad[0, 3]).max() == 0  # the last position: no group


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory):
  """(512-id, 1024-id) byte-level BPEs trained on the same corpus."""
  root = tmp_path_factory.mktemp("bpe")
  return tuple(make_tokenizer(f"hf:{trained_bpe(root / str(n), n)}") for n in (512, 1024))


def _record(tok, text):
  """[<s>] + text + [</s>] with byte spans (the specials have none)."""
  ids, spans = encode_with_byte_offsets(tok, text)
  end = len(text.encode())
  return (np.concatenate([[tok.bos_id], ids, [tok.eos_id]]),
          np.concatenate([[(0, 0)], spans, [(end, end)]]))


def _batch(student, teacher, texts, to_student, L, M) -> AlignedTargets:
  """The aligned targets of `texts`, one row each, padded to L student / M teacher positions."""
  B = len(texts)
  arrays = [np.full((B, n), -1, np.int32) for n in (L, M, L, M, L)]
  for b, text in enumerate(texts):
    (s_ids, s_spans), (t_ids, t_spans) = _record(student, text), _record(teacher, text)
    aligned = alignment_targets(align_spans(s_spans, t_spans), s_ids, t_ids, to_student)
    values = (_targets(s_ids), _targets(t_ids), aligned["student_group_N"],
              aligned["teacher_group_M"], aligned["group_kind_G"])
    for array, value in zip(arrays, values):
      array[b, :len(value)] = value
  arrays[0], arrays[1] = np.maximum(arrays[0], 0), np.maximum(arrays[1], 0)
  arrays[4] = np.maximum(arrays[4], SKIP)
  return AlignedTargets(*arrays)


def test_one_tokenizer_on_both_sides_is_token_level_kl(bpe_pair):
  tokenizer = bpe_pair[0]
  shared = shared_vocab(tokenizer, tokenizer)
  np.testing.assert_array_equal(shared.student_ids_S, np.arange(512))
  texts = corpus_sentences(2, seed=7)
  L = max(len(_record(tokenizer, t)[0]) for t in texts)
  aligned = _batch(tokenizer, tokenizer, texts, shared.teacher_to_student_Vt, L, L)
  rng = np.random.default_rng(2)
  s_logits = jnp.asarray(rng.normal(size=(2, L, 512)), jnp.float32)
  t_logits = jnp.asarray(rng.normal(size=(2, L, 512)) * 1.5, jnp.float32)
  per_group = jax.jit(per_group_terms)(s_logits, t_logits, aligned, shared.student_ids_S,
                                       shared.teacher_ids_S)
  kl_BxL = kl(jax.nn.log_softmax(t_logits), jax.nn.log_softmax(s_logits))
  # Position i predicts token i + 1, whose group is student_group[b, i]: one group per position.
  group_BxL = aligned.student_group_BxL
  want_BxG = np.zeros(group_BxL.shape, np.float32)
  b_idx, i_idx = np.nonzero(group_BxL >= 0)
  want_BxG[b_idx, group_BxL[b_idx, i_idx]] = np.asarray(kl_BxL)[b_idx, i_idx]
  assert len(b_idx) == sum(len(_record(tokenizer, t)[0]) - 1 for t in texts)  # every next token
  np.testing.assert_allclose(per_group["exact_kl"], want_BxG, rtol=0, atol=1e-6)
  assert not np.asarray(per_group["span_kl"]).any() and not np.asarray(per_group["uld"]).any()


def test_two_tokenizers_batch_rows_are_independent(bpe_pair):
  """512-id student, 1024-id teacher: a batch of two records scores each row as it scores that
  record alone (the groups of one row never read another's positions)."""
  student, teacher = bpe_pair
  shared = shared_vocab(student, teacher)
  texts = corpus_sentences(2, seed=11)
  L, M = 40, 40
  both = _batch(student, teacher, texts, shared.teacher_to_student_Vt, L, M)
  assert (both.group_kind_BxG == SPAN).sum() > 0 and (both.group_kind_BxG == EXACT).sum() > 0
  rng = np.random.default_rng(3)
  s_logits = jnp.asarray(rng.normal(size=(2, L, 512)), jnp.float32)
  t_logits = jnp.asarray(rng.normal(size=(2, M, 1024)), jnp.float32)
  terms = jax.jit(per_group_terms)
  together = terms(s_logits, t_logits, both, shared.student_ids_S, shared.teacher_ids_S)
  for b, text in enumerate(texts):
    alone = terms(s_logits[b:b + 1], t_logits[b:b + 1],
                  _batch(student, teacher, [text], shared.teacher_to_student_Vt, L, M),
                  shared.student_ids_S, shared.teacher_ids_S)
    for name in together:
      np.testing.assert_allclose(together[name][b], alone[name][0], rtol=1e-6, atol=1e-7)
      assert np.isfinite(together[name]).all()
