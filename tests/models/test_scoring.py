"""models/scoring.TokenScorer: rows of any length scored in length buckets equal the model's own
log-softmax, and a row asked twice is scored once."""

import numpy as np

from distillax.models.scoring import TokenScorer
from tests.support.models import TINY1, logits, random_model


def test_scores_equal_the_log_softmax_and_repeated_rows_are_scored_once():
  model = random_model(TINY1, seed=3)
  rng = np.random.default_rng(0)
  a, b = (rng.integers(0, TINY1.vocab_size, size=n).tolist() for n in (5, 40))
  scorer = TokenScorer(model, batch_size=2, min_len=8)
  out = scorer([a, b, a, list(a)])
  assert out[0] is out[2] is out[3]  # one result object: the repeat was not scored again
  assert scorer.compiled_shapes == {(2, 64)}  # a and b in one batch, padded to b's bucket
  for row, (logprob_T, is_top_T) in zip((a, b), out[:2]):
    z = np.asarray(logits(model, np.asarray([row[:-1]])), np.float64)[0]
    logp_TxV = z - z.max(-1, keepdims=True)
    logp_TxV -= np.log(np.exp(logp_TxV).sum(-1, keepdims=True))
    t = np.arange(len(row) - 1)
    np.testing.assert_allclose(logprob_T, logp_TxV[t, row[1:]], atol=2e-5)
    np.testing.assert_array_equal(is_top_T, z.argmax(-1) == np.asarray(row[1:]))


def test_scores_over_the_tokenizers_ids_leave_the_padded_rows_out():
  """With vocab_limit (the tokenizer's ids, as the lm-eval harness passes them), each score is
  the log-softmax over the first vocab_limit logits: what the run's export, which holds only
  those rows, scores (issue 55)."""
  model = random_model(TINY1, seed=3)
  limit = TINY1.vocab_size - 40
  row = np.random.default_rng(1).integers(0, limit, size=20).tolist()
  (logprob_T, is_top_T), = TokenScorer(model, batch_size=2, min_len=8, vocab_limit=limit)([row])
  z = np.asarray(logits(model, np.asarray([row[:-1]])), np.float64)[0][:, :limit]
  logp_TxV = z - z.max(-1, keepdims=True)
  logp_TxV -= np.log(np.exp(logp_TxV).sum(-1, keepdims=True))
  t = np.arange(len(row) - 1)
  np.testing.assert_allclose(logprob_T, logp_TxV[t, row[1:]], atol=2e-5)
  np.testing.assert_array_equal(is_top_T, z.argmax(-1) == np.asarray(row[1:]))
