"""The eval guard (framework/eval_rules.py) on scripted figure sequences: rollback when the
watched figure worsens past the threshold in its own direction, early stop when it has not
improved for `patience` evals, and one line for a figure of unknown direction."""

import math

import pytest

from distillax.errors import ConfigError
from distillax.framework.eval_rules import CONTINUE, ROLLBACK, STOP, EvalGuard


def _verdicts(guard, values):
  return [guard.judge(v) for v in values]


def test_a_higher_is_better_figure_that_drops_rolls_back():
  # best 12; 11.5 is within 5% (12 - 0.6 = 11.4), 11.3 is not
  guard = EvalGuard("eval_bleu", threshold=0.05)
  assert _verdicts(guard, [10.0, 12.0, 11.5, 11.3]) == [CONTINUE] * 3 + [ROLLBACK]
  assert guard.best == 12.0
  # The same drop read as a loss (lower is better) is a gain, and a rise is what rolls back.
  loss = EvalGuard("eval_loss", threshold=0.05)
  assert _verdicts(loss, [12.0, 11.3, 12.0]) == [CONTINUE, CONTINUE, ROLLBACK]
  assert loss.best == 11.3


def test_a_lower_is_better_figure_that_rises_rolls_back():
  guard = EvalGuard("eval_perplexity", threshold=0.05)
  # 2.8 * 1.05 = 2.94: 2.93 stays, 2.95 goes back
  assert _verdicts(guard, [3.0, 2.8, 2.93, 2.95]) == [CONTINUE] * 3 + [ROLLBACK]
  assert EvalGuard("eval_rouge_l", 0.05).judge(math.nan) == ROLLBACK


def test_early_stop_after_patience_evals_without_improvement():
  guard = EvalGuard("eval_chrf", threshold=0.5, patience=2)
  # 31 improves (stale back to 0); 30.5 and 30.9 do not improve on 31: the second one stops
  assert _verdicts(guard, [30.0, 29.0, 31.0, 30.5, 30.9]) == [CONTINUE] * 4 + [STOP]
  assert (guard.best, guard.stale) == (31.0, 2)
  guard.rolled_back()
  assert guard.judge(30.0) == CONTINUE  # counting starts again at the best checkpoint
  assert EvalGuard("eval_accuracy", 0.5).judge(0.1) == CONTINUE  # patience 0: never stops


def test_a_figure_of_unknown_direction_is_one_line():
  with pytest.raises(ConfigError) as e:
    EvalGuard("eval_teacher_ce", 0.05)
  assert str(e.value).startswith("train.rollback_metric='eval_teacher_ce': distillax does not "
                                 "know which way that figure improves; use one of eval_objective")
  assert "\n" not in str(e.value)


def test_every_figure_a_registered_job_may_watch_has_a_direction():
  from distillax.framework.eval_rules import DIRECTIONS
  from distillax.trainers import registry
  from distillax.trainers.generation_eval import GENERATION_FIGURES
  figures = {f for cls in registry._RECIPES.values() for f in cls.rollback_metrics}
  assert "eval_accuracy" in figures and "eval_on_policy_reverse_kl" in figures
  assert sorted((figures | set(GENERATION_FIGURES)) - set(DIRECTIONS)) == []
