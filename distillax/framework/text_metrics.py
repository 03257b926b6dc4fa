"""Generation metrics of completions against references, as the field reports them: sacreBLEU's
BLEU and chrF (corpus level: n-gram statistics summed over every pair before the score, not an
average of sentence scores; sacreBLEU's default '13a' tokenization, so figures compare with
published ones) and ROUGE-L (rouge-score's F-measure per pair, averaged: what summarisation
tables report, with its default tokenizer and no stemming).

The libraries come with the eval extra (lm-eval pulls both); nothing here imports them until a
score is asked for.
"""

from __future__ import annotations

from distillax.errors import UserError

_NEEDS = "needs the eval extra (sacrebleu, rouge-score): pip install 'distillax[eval]'"


def _check(completions: list[str], references: list[str]) -> None:
  if len(completions) != len(references):
    raise UserError(f"{len(completions)} completions for {len(references)} references: score "
                    f"one completion per reference")
  if not completions:
    raise UserError("no completions to score")


def bleu_chrf(completions: list[str], references: list[str]) -> dict[str, float]:
  """Corpus BLEU and chrF (0-100) of the completions, one reference each."""
  _check(completions, references)
  try:
    import sacrebleu
  except ImportError:
    raise UserError(f"BLEU and chrF {_NEEDS}") from None
  return {"bleu": float(sacrebleu.corpus_bleu(completions, [references]).score),
          "chrf": float(sacrebleu.corpus_chrf(completions, [references]).score)}


def rouge_l(completions: list[str], references: list[str]) -> float:
  """Mean ROUGE-L F-measure (0-1) over the pairs."""
  _check(completions, references)
  try:
    from rouge_score import rouge_scorer
  except ImportError:
    raise UserError(f"ROUGE-L {_NEEDS}") from None
  scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
  scores = [scorer.score(ref, out)["rougeL"].fmeasure for out, ref in zip(completions, references)]
  return float(sum(scores) / len(scores))


def generation_scores(completions: list[str], references: list[str]) -> dict[str, float]:
  """bleu, chrf (0-100) and rouge_l (0-1) of the completions against their references."""
  return dict(bleu_chrf(completions, references), rouge_l=rouge_l(completions, references))
