"""Per-prompt on-policy figures and their standard errors over prompts.

An on-policy figure is a ratio of sums over held-out prompts: Σ_i s_i / Σ_i n_i (s_i the
teacher's NLL, or the reverse KL, summed over prompt i's completion; n_i its tokens). The tokens
of one completion are not independent draws (they share a prompt and a sampled prefix), so the
sampling unit is the prompt, and the standard error is the ratio estimator's over prompts
(linearised: the residuals s_i - R n_i, with the K / (K - 1) correction). With equal lengths it
is the usual std(ddof=1) / sqrt(K) of the per-prompt means.

Two rows complete the same prompts, so their difference is judged per prompt (paired): the
prompts' difficulty, which moves both rows alike, cancels, and what is left is how differently
the two students write on the same prompt. The difference of the two ratios is linearised per
prompt, d_i = (a_i - R_a n_i) / mean(n) - (b_i - R_b m_i) / mean(m), and its standard error is
sqrt(K / (K - 1) · Σ d_i²) / K (the same estimator as one ratio's, which it reduces to when one
row is constant). A row "beats" another when it is lower by more than two of those standard
errors. The unpaired sqrt(SE_a² + SE_b²) is reported beside it: it charges the difference with
the spread of prompt difficulty, which both rows share.
"""

from __future__ import annotations

import math

import numpy as np


def _linearised(sums_K, counts_K) -> np.ndarray:
  """Per unit, its share of the ratio's deviation: (s_i - R n_i) / mean(n)."""
  s_K, n_K = np.asarray(sums_K, np.float64), np.asarray(counts_K, np.float64)
  return (s_K - s_K.sum() / n_K.sum() * n_K) / n_K.mean()


def _standard_error(d_K: np.ndarray) -> float:
  """sqrt(K / (K - 1) · Σ d_i²) / K of linearised deviations; NaN under two units."""
  k = len(d_K)
  return math.sqrt(k / (k - 1) * float(np.sum(d_K ** 2))) / k if k >= 2 else float("nan")


def ratio_and_se(sums_K, counts_K) -> tuple[float, float]:
  """(Σ sums / Σ counts, its standard error over the K units); NaN SE under two units."""
  ratio = float(np.sum(sums_K)) / float(np.sum(counts_K))
  return ratio, _standard_error(_linearised(sums_K, counts_K))


def per_prompt_sums(completions, student_logps, teacher_logps) -> dict[str, np.ndarray]:
  """Per prompt: the teacher's NLL of the completion's tokens, KL(student || teacher) summed
  over its positions (full vocabulary) and its token count. `student_logps`/`teacher_logps`:
  each completion's log-softmax at the positions predicting it, [(T_i, V)]."""
  nll, rkl, tokens = [], [], []
  for ids, s_logp_TxV, t_logp_TxV in zip(completions, student_logps, teacher_logps):
    ids = np.asarray(ids, np.int64)
    nll.append(-float(t_logp_TxV[np.arange(len(ids)), ids].sum()))
    rkl.append(float((np.exp(s_logp_TxV) * (s_logp_TxV - t_logp_TxV)).sum()))
    tokens.append(len(ids))
  return {"teacher_nll": np.asarray(nll), "reverse_kl": np.asarray(rkl),
          "tokens": np.asarray(tokens, np.float64)}


def figures_with_se(sums: dict[str, np.ndarray]) -> dict[str, float]:
  """on_policy_teacher_nll / on_policy_reverse_kl per token and their *_se over prompts."""
  out = {}
  for fig in ("teacher_nll", "reverse_kl"):
    value, se = ratio_and_se(sums[fig], sums["tokens"])
    out[f"on_policy_{fig}"], out[f"on_policy_{fig}_se"] = value, se
  return out


def paired_difference(lower_sums, lower_counts, higher_sums, higher_counts
                      ) -> tuple[float, float]:
  """(R_higher - R_lower, its standard error over the K prompts both rows completed)."""
  if len(lower_sums) != len(higher_sums):
    raise ValueError(f"paired rows need the same prompts: {len(lower_sums)} against "
                     f"{len(higher_sums)}")
  diff = (float(np.sum(higher_sums)) / float(np.sum(higher_counts))
          - float(np.sum(lower_sums)) / float(np.sum(lower_counts)))
  d_K = _linearised(higher_sums, higher_counts) - _linearised(lower_sums, lower_counts)
  return diff, _standard_error(d_K)


def compare(lower: dict, higher: dict, fig: str) -> dict[str, float | bool]:
  """`lower` beats `higher` on `fig` (per-prompt sums of both, per_prompt_sums' keys): the
  difference higher - lower, its paired SE, the unpaired SE, and whether it exceeds 2 paired SE."""
  diff, se = paired_difference(lower[fig], lower["tokens"], higher[fig], higher["tokens"])
  unpaired = math.hypot(ratio_and_se(lower[fig], lower["tokens"])[1],
                        ratio_and_se(higher[fig], higher["tokens"])[1])
  return {"difference": diff, "paired_se": se, "unpaired_se": unpaired,
          "beats": bool(diff > 2.0 * se)}


__all__ = ["compare", "figures_with_se", "paired_difference", "per_prompt_sums", "ratio_and_se"]
