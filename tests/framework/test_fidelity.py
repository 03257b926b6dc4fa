"""Quantization-fidelity figures against NumPy (float64) on random logits, and by hand."""

import numpy as np
import pytest

from distillax.errors import UserError
from distillax.framework import fidelity


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _nucleus_holds(p_V, token, top_p):
  """The token is among the fp model's top-p tokens: sorted by falling probability (ties by
  id), cut after the first whose running mass reaches top_p."""
  order = np.argsort(-p_V, kind="stable")
  cut = int(np.argmax(np.cumsum(p_V[order]) >= top_p))
  return token in order[:cut + 1]


@pytest.fixture(scope="module")
def logits():
  rng = np.random.default_rng(0)
  fp = rng.normal(size=(64, 50)) * 2.0
  quant = fp + rng.normal(size=fp.shape) * 0.7
  targets = rng.integers(0, 50, size=64)
  mask = rng.random(64) > 0.25
  return fp.astype(np.float32), quant.astype(np.float32), targets, mask


def test_every_figure_equals_numpy(logits):
  fp, quant, targets, mask = logits
  lp, lq = _log_softmax(fp.astype(np.float64)), _log_softmax(quant.astype(np.float64))
  kl = (np.exp(lp) * (lp - lq)).sum(-1)[mask]
  top1 = (fp.argmax(-1) == quant.argmax(-1))[mask]
  nucleus = np.array([_nucleus_holds(np.exp(lp[i]), quant[i].argmax(), 0.5)
                      for i in range(len(fp))])[mask]
  nll_p = -lp[np.arange(64), targets][mask]
  nll_q = -lq[np.arange(64), targets][mask]
  got = fidelity.fidelity(fp, quant, targets, mask, top_p=0.5)
  want = {"kl_mean": kl.mean(), "kl_p99": np.percentile(kl, 99), "kl_max": kl.max(),
          "same_top1": top1.mean(), "in_top_p0.5": nucleus.mean(),
          "perplexity_ratio": np.exp(nll_q.mean() - nll_p.mean())}
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=2e-5, err_msg=key)
  assert 0 < want["same_top1"] < want["in_top_p0.5"] < 1  # the figures tell models apart


def test_top_p_nucleus_by_hand():
  fp = np.log(np.array([[0.5, 0.3, 0.2]] * 3, np.float32))
  quant = np.eye(3, dtype=np.float32) * 5  # row i's top token is i
  assert np.asarray(fidelity.in_top_p(fp, quant, 0.6)).tolist() == [True, True, False]
  assert np.asarray(fidelity.in_top_p(fp, quant, 0.4)).tolist() == [True, False, False]
  assert np.asarray(fidelity.in_top_p(fp, quant, 0.9)).tolist() == [True, True, True]


def test_recovery_by_hand_and_refused_without_a_gap():
  assert fidelity.recovery(2.5, 2.2, 2.0) == pytest.approx(0.6)
  assert fidelity.recovery(2.5, 2.6, 2.0) == pytest.approx(-0.2)  # QAT worse than PTQ
  with pytest.raises(UserError, match="lost nothing to recover"):
    fidelity.recovery(2.0, 1.9, 2.0)
  with pytest.raises(UserError, match="keeps none"):
    fidelity.kl_summary(np.ones(3), np.zeros(3, bool))
