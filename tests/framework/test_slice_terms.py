"""Several distillation terms over vocabulary slices in one pass (framework/slice_terms.py,
`vocab_slices.Spec.terms`): the loss, each term's divergence sum and the gradients by the
student's output weight and hidden states against the whole-logits formulas (float64 numpy for
the sums, jax.grad through jax.nn.log_softmax for the gradients). The objective over a Composite
of LogitKDs against the chunk engine: tests/distill/test_sliced_terms.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.framework import slice_terms, vocab_slices
from tests.distill.helpers import f64, np_log_softmax
from tests.framework.test_vocab_slices import (OPERANDS_N, OPERANDS_V, _divergence,
                                               random_operands)
from tests.support import chip

# (temperature, divergence, beta, kd weight) of each term
CASES = {
    "two_forward_kl_at_two_temperatures": ((2.0, "forward_kl", 0.5, 0.7 * 4),
                                           (1.0, "forward_kl", 0.5, 0.3)),
    "forward_kl_and_jsd": ((2.0, "forward_kl", 0.5, 1.2), (1.5, "jsd", 0.3, 0.8)),
    "reverse_kl_and_forward_kl_same_temperature": ((2.0, "reverse_kl", 0.5, 0.4 * 4),
                                                   (2.0, "forward_kl", 0.5, 0.9 * 4)),
    "three_terms_two_jsds": ((1.0, "jsd", 0.2, 0.5), (3.0, "jsd", 0.7, 2.0),
                             (3.0, "reverse_kl", 0.5, 1.0)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("slice_size,vocab_axis,softcap", [(128, 0, None), (96, 1, 5.0)])
def test_several_terms_equal_the_whole_logits_formulas(case, slice_size, vocab_axis, softcap):
  """V = 300 in slices of 128 (the last shifted back over 44 columns already seen) or 96 (an
  untied, soft-capped head), a teacher head 20 columns wider (only the student's count), 37
  tokens of which about a fifth are masked out: each term's divergence sum within 1e-5 of
  float64 numpy, the loss within 1e-5 and both gradients within 1e-5 of their scale of
  autodiff through whole logits."""
  N, V, ce = OPERANDS_N, OPERANDS_V, 0.45
  terms = tuple(slice_terms.Term(kd_weight=w, temperature=T, divergence=d, beta=b)
                for T, d, b, w in CASES[case])
  w, h, w_t, h_t, y, mask = random_operands(1, vocab_axis)
  assert 0 < float(jnp.sum(mask)) < N
  spec = vocab_slices.Spec(ce_weight=ce, terms=terms, slice_size=slice_size, accuracy=True)
  cap = (lambda z: z) if softcap is None else (lambda z: softcap * jnp.tanh(z / softcap))

  def whole(w, h):
    s = cap(h @ (w.T if vocab_axis == 0 else w))
    t = (h_t @ w_t)[:, :V]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(s, -1), y[:, None], -1)[:, 0]
    loss_N = ce * nll
    for term in terms:
      lt = jax.nn.log_softmax(t / term.temperature, -1)
      ls = jax.nn.log_softmax(s / term.temperature, -1)
      loss_N = loss_N + term.kd_weight * _divergence(term.divergence, lt, ls, term.beta, jnp)
    return jnp.sum(loss_N * mask), s

  def sliced(w, h):
    return vocab_slices.token_sums(spec, vocab_slices.Head(w, vocab_axis, "float32", softcap), h,
                                   y, mask, vocab_slices.Head(w_t, 1, "float32"), h_t)

  with jax.default_matmul_precision("highest"):
    (loss, sums), grads = jax.value_and_grad(sliced, argnums=(0, 1), has_aux=True)(w, h)
    (want_loss, s), want_grads = jax.value_and_grad(whole, argnums=(0, 1), has_aux=True)(w, h)
    t = f64((h_t @ w_t)[:, :V])
  s, m = f64(s), f64(mask)
  assert "divergence" not in sums and len(sums["divergences"]) == len(terms)
  for term, got in zip(terms, sums["divergences"]):
    T = term.temperature
    div = _divergence(term.divergence, np_log_softmax(t / T), np_log_softmax(s / T), term.beta,
                      np)
    chip.assert_close(got, np.sum(div * m), rtol=1e-5)
  nll = -np_log_softmax(s)[np.arange(N), np.asarray(y)]
  chip.assert_close(sums["nll"], np.sum(nll * m), rtol=1e-5)
  assert float(sums["correct"]) == np.sum((np.argmax(s, -1) == np.asarray(y)) * m)
  chip.assert_close(loss, want_loss, rtol=1e-5)
  for g, want in zip(grads, want_grads):
    chip.assert_close(g, want, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_terms_share_one_pair_of_normalisers_per_temperature():
  """Three terms at two temperatures carry two pairs of normalisers, and a KL sum for each KL
  term only (a jsd's comes from its second pass)."""
  terms = (slice_terms.Term(1.0, 2.0), slice_terms.Term(1.0, 2.0, "jsd", 0.3),
           slice_terms.Term(1.0, 1.0, "reverse_kl"))
  assert slice_terms.temperatures(terms) == (2.0, 1.0)
  carry = slice_terms.init(terms, 5)
  assert len(carry["norm"]) == 2 and [a is None for a in carry["a"]] == [False, True, False]


def test_terms_refuse_what_they_do_not_combine():
  """Terms take the teacher's head and no single-term KD, top-k or target term beside them."""
  N, V = 4, 8
  head = vocab_slices.Head(jnp.ones((V, 3)), 0, "float32")
  h, y, mask = jnp.ones((N, 3)), jnp.zeros((N,), jnp.int32), jnp.ones((N,))
  terms = (slice_terms.Term(1.0), slice_terms.Term(1.0, 2.0))
  for spec, teacher in ((vocab_slices.Spec(terms=terms), None),
                        (vocab_slices.Spec(terms=terms, kd_weight=1.0), head)):
    with pytest.raises(ValueError, match="spec.terms needs the teacher's head"):
      vocab_slices.token_sums(spec, head, h, y, mask, teacher, None if teacher is None else h)
  with pytest.raises(ValueError, match="divergence 'kl'"):
    vocab_slices.token_sums(vocab_slices.Spec(terms=(slice_terms.Term(1.0, 1.0, "kl"),)), head,
                            h, y, mask, head, h)
