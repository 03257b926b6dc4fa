"""The on-policy figures' standard errors over prompts (demo/prompt_stats.py) against numpy and
hand-computed values, and the 2-SE rule the demo's claims use."""

import math

import numpy as np
import pytest

from distillax.demo import prompt_stats


def test_ratio_se_is_the_standard_error_of_the_mean_with_equal_lengths():
  per_token_K = np.array([2.0, 2.5, 1.5, 3.0, 2.2])
  ratio, se = prompt_stats.ratio_and_se(per_token_K * 8, np.full(5, 8))
  assert ratio == pytest.approx(per_token_K.mean())
  assert se == pytest.approx(np.std(per_token_K, ddof=1) / math.sqrt(5))


def test_ratio_se_by_hand_with_unequal_lengths():
  # sums 3, 1; tokens 2, 2 -> R = 1; residuals 1, -1; SE = sqrt(2 / 1 * 2) / 4 = 0.5
  assert prompt_stats.ratio_and_se([3.0, 1.0], [2, 2]) == pytest.approx((1.0, 0.5))
  # sums 4, 2; tokens 3, 1 -> R = 1.5; residuals -0.5, 0.5; SE = sqrt(2 * 0.5) / 4 = 0.25
  assert prompt_stats.ratio_and_se([4.0, 2.0], [3, 1]) == pytest.approx((1.5, 0.25))
  assert math.isnan(prompt_stats.ratio_and_se([4.0], [3])[1])


def test_per_prompt_sums_against_numpy():
  rng = np.random.default_rng(0)
  completions = [[1, 0, 2], [3]]
  logits = [rng.normal(size=(len(c), 4)) for c in completions]
  student = [z - np.log(np.exp(z).sum(-1, keepdims=True)) for z in logits]
  teacher = [np.log(np.full((len(c), 4), 0.25)) for c in completions]  # uniform teacher
  sums = prompt_stats.per_prompt_sums(completions, student, teacher)
  np.testing.assert_allclose(sums["teacher_nll"], [3 * math.log(4), math.log(4)])
  np.testing.assert_array_equal(sums["tokens"], [3, 1])
  # KL(p || uniform) = log 4 - H(p), summed over positions
  entropy = [-(np.exp(s) * s).sum() for s in student]
  np.testing.assert_allclose(sums["reverse_kl"],
                             [3 * math.log(4) - entropy[0], math.log(4) - entropy[1]])
  figures = prompt_stats.figures_with_se(sums)
  assert figures["on_policy_teacher_nll"] == pytest.approx(math.log(4))
  assert figures["on_policy_teacher_nll_se"] == pytest.approx(0.0, abs=1e-12)


def test_paired_difference_is_the_standard_error_of_per_prompt_differences_with_equal_lengths():
  rng = np.random.default_rng(1)
  difficulty_K = rng.normal(2.5, 0.5, size=12)  # shared by both rows
  off_K = difficulty_K + rng.normal(0, 0.05, 12)
  on_K = difficulty_K - 0.1 + rng.normal(0, 0.05, 12)
  diff, se = prompt_stats.paired_difference(on_K * 4, np.full(12, 4), off_K * 4, np.full(12, 4))
  assert diff == pytest.approx(off_K.mean() - on_K.mean())
  assert se == pytest.approx(np.std(off_K - on_K, ddof=1) / math.sqrt(12))
  # Against a constant row it is that row's own ratio SE.
  r, r_se = prompt_stats.ratio_and_se(off_K * 4, np.full(12, 4))
  assert prompt_stats.paired_difference(np.zeros(12), np.full(12, 4), off_K * 4,
                                        np.full(12, 4)) == pytest.approx((r, r_se))


def test_paired_difference_by_hand_with_unequal_lengths():
  # lower: sums 2, 2; tokens 2, 2 -> R 1, residuals 0, 0. higher: sums 4, 2; tokens 3, 1 ->
  # R 1.5, residuals / mean(n)=2: -0.25, 0.25. d = -0.25, 0.25; SE = sqrt(2 * 0.125) / 2 = 0.25
  assert prompt_stats.paired_difference([2.0, 2.0], [2, 2], [4.0, 2.0], [3, 1]) == \
      pytest.approx((0.5, 0.25))
  with pytest.raises(ValueError, match="same prompts"):
    prompt_stats.paired_difference([1.0], [1], [1.0, 2.0], [1, 1])


def test_beats_needs_more_than_two_paired_standard_errors():
  shared_K = np.array([1.0, 3.0, 2.0, 4.0])  # prompt difficulty: a large unpaired SE
  tokens = np.full(4, 1.0)
  rows = {name: {"teacher_nll": shared_K + shift + np.array([0.01, -0.01, 0.02, -0.02]) * k,
                 "tokens": tokens} for name, shift, k in (("on", 0.0, 1), ("off", 0.3, -1))}
  cmp = prompt_stats.compare(rows["on"], rows["off"], "teacher_nll")
  assert cmp["difference"] == pytest.approx(0.3)
  # per-prompt differences 0.28, 0.32, 0.26, 0.34: SE = std(ddof=1) / 2
  assert cmp["paired_se"] == pytest.approx(np.std([0.28, 0.32, 0.26, 0.34], ddof=1) / 2)
  assert cmp["unpaired_se"] > 10 * cmp["paired_se"] and cmp["beats"]
  assert not prompt_stats.compare(rows["off"], rows["on"], "teacher_nll")["beats"]
  rows["off"]["teacher_nll"] = rows["on"]["teacher_nll"] + np.array([0.1, -0.1, 0.12, -0.08])
  assert not prompt_stats.compare(rows["on"], rows["off"], "teacher_nll")["beats"]  # 0.01 ± 0.06
