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


def test_beats_needs_more_than_two_standard_errors_of_the_difference():
  # difference 0.3; SE of the difference sqrt(0.1² + 0.1²) = 0.1414: 0.3 > 0.283
  assert prompt_stats.beats(1.0, 0.1, 1.3, 0.1)
  assert not prompt_stats.beats(1.0, 0.1, 1.25, 0.1)  # 0.25 < 0.283
  assert not prompt_stats.beats(1.3, 0.01, 1.0, 0.01)  # higher, not lower
