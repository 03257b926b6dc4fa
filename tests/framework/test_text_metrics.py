"""BLEU, chrF and ROUGE-L of completions against the libraries' own functions on fixed strings:
corpus-level sacreBLEU (not a mean of sentence scores), rouge-score's F-measure per pair."""

import numpy as np
import pytest
import sacrebleu
from rouge_score import rouge_scorer

from distillax.errors import UserError
from distillax.framework.text_metrics import generation_scores

OUTS = ["the cat sat on the mat", "a quick brown fox jumps over the dog",
        "def add(a, b): return a + b", "hello"]
REFS = ["the cat is on the mat", "the quick brown fox jumps over the lazy dog",
        "def add(a, b): return a + b", "hello world"]


def test_scores_equal_the_libraries_corpus_and_per_pair():
  got = generation_scores(OUTS, REFS)
  assert got["bleu"] == sacrebleu.corpus_bleu(OUTS, [REFS]).score
  assert got["chrf"] == sacrebleu.corpus_chrf(OUTS, [REFS]).score
  sentence_mean = np.mean([sacrebleu.sentence_bleu(o, [r]).score for o, r in zip(OUTS, REFS)])
  assert abs(got["bleu"] - sentence_mean) > 1  # corpus statistics, not a mean of sentences
  scorer = rouge_scorer.RougeScorer(["rougeL"])
  want = np.mean([scorer.score(r, o)["rougeL"].fmeasure for o, r in zip(OUTS, REFS)])
  assert got["rouge_l"] == pytest.approx(want, abs=1e-12)


def test_scores_by_hand():
  same = generation_scores(REFS, REFS)
  assert same == {"bleu": pytest.approx(100.0), "chrf": pytest.approx(100.0), "rouge_l": 1.0}
  # LCS of "a b c d" and "a c d e" is "a c d": precision = recall = 3/4.
  assert generation_scores(["a b c d"], ["a c d e"])["rouge_l"] == pytest.approx(0.75)
  with pytest.raises(UserError, match="2 completions for 1 references"):
    generation_scores(["a", "b"], ["a"])
