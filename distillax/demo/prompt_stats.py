"""Per-prompt on-policy figures and their standard errors over prompts.

An on-policy figure is a ratio of sums over held-out prompts: Σ_i s_i / Σ_i n_i (s_i the
teacher's NLL, or the reverse KL, summed over prompt i's completion; n_i its tokens). The tokens
of one completion are not independent draws (they share a prompt and a sampled prefix), so the
sampling unit is the prompt, and the standard error is the ratio estimator's over prompts
(linearised: the residuals s_i - R n_i, with the K / (K - 1) correction). With equal lengths it
is the usual std(ddof=1) / sqrt(K) of the per-prompt means.

Two figures are said to differ when their difference exceeds two standard errors of the
difference, taken as sqrt(SE_a² + SE_b²): no credit for the rows sharing their prompts, so a
difference that passes passes under any pairing.
"""

from __future__ import annotations

import math

import numpy as np


def ratio_and_se(sums_K, counts_K) -> tuple[float, float]:
  """(Σ sums / Σ counts, its standard error over the K units); NaN SE under two units."""
  s_K, n_K = np.asarray(sums_K, np.float64), np.asarray(counts_K, np.float64)
  total = float(n_K.sum())
  ratio = float(s_K.sum()) / total
  k = len(s_K)
  if k < 2:
    return ratio, float("nan")
  resid_K = s_K - ratio * n_K
  return ratio, math.sqrt(k / (k - 1) * float(np.sum(resid_K ** 2))) / total


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


def beats(lower: float, lower_se: float, higher: float, higher_se: float) -> bool:
  """Whether `lower` is below `higher` by more than two standard errors of the difference."""
  return bool(higher - lower > 2.0 * math.sqrt(lower_se ** 2 + higher_se ** 2))


__all__ = ["beats", "figures_with_se", "per_prompt_sums", "ratio_and_se"]
