"""Which way each eval figure improves, and the rule that watches one during training.

A job's guard watches one logged eval figure (`train.rollback_metric`): perplexity and the
distillation losses improve downwards, BLEU, chrF, ROUGE-L, accuracy and top-1 agreement
upwards. The direction of every figure a guard may watch is declared here, once: the trainer's
rollback and early stop, and the checkpoint manager's "best step", read it from here, so a
higher-is-better figure is never ranked as a loss.

    guard = EvalGuard("eval_bleu", threshold=0.05, patience=3)
    verdict = guard.judge(value)   # CONTINUE, ROLLBACK or STOP

ROLLBACK: the figure is not finite, or worse than the best so far by more than `threshold` of
the best's size in its own direction (a BLEU of 20 after a best of 22 with threshold 0.05).
STOP: it has not improved on the best for `patience` evals in a row (0 = never stop early).
The guard is a pure state machine over the sequence of values, so its rule is tested without
training; the trainer keeps `best` and `stale` in each checkpoint to resume it exactly.
"""

from __future__ import annotations

import dataclasses
import math

from distillax.errors import ConfigError

LOWER, HIGHER = "lower", "higher"

# Every eval figure a guard may watch, with the way it improves: the one place a direction is
# declared. A recipe lists the figures its eval reports (Recipe.rollback_metrics); the in-training
# generation eval (eval.generate) adds the last three.
DIRECTIONS: dict[str, str] = {
    "eval_objective": LOWER,  # the objective's own loss
    "eval_loss": LOWER,  # next-token cross-entropy
    "eval_perplexity": LOWER,
    "eval_accuracy": HIGHER,  # next-token argmax accuracy (lm, sequence_kd)
    "eval_top1_agreement": HIGHER,  # student's top token is the teacher's (distillation)
    "eval_on_policy_reverse_kl": LOWER,
    "eval_on_policy_teacher_nll": LOWER,
    "eval_bleu": HIGHER,  # sacreBLEU corpus BLEU of greedy completions (0-100)
    "eval_chrf": HIGHER,  # sacreBLEU chrF (0-100)
    "eval_rouge_l": HIGHER,  # mean ROUGE-L F-measure (0-1)
}

CONTINUE, ROLLBACK, STOP = "continue", "rollback", "stop"


def direction_of(name: str) -> str:
  """LOWER or HIGHER; a ConfigError naming the figures with a known direction otherwise."""
  if name not in DIRECTIONS:
    raise ConfigError(f"train.rollback_metric={name!r}: distillax does not know which way that "
                      f"figure improves; use one of {', '.join(DIRECTIONS)}")
  return DIRECTIONS[name]


def better(value: float, than: float, direction: str) -> bool:
  """Whether `value` strictly improves on `than` in `direction`."""
  return value < than if direction == LOWER else value > than


def worse_beyond(value: float, best: float, direction: str, threshold: float) -> bool:
  """Whether `value` is worse than `best` by more than `threshold` x |best| in `direction`."""
  margin = threshold * abs(best)
  return value > best + margin if direction == LOWER else value < best - margin


@dataclasses.dataclass
class EvalGuard:
  """Rollback and early stop on one eval figure (see the module docstring)."""

  metric: str
  threshold: float  # train.rollback_threshold: the share of the best a figure may worsen by
  patience: int = 0  # train.early_stop_evals: evals without improvement before stopping; 0 = off
  best: float | None = None  # the best value so far
  stale: int = 0  # evals since `best` last improved

  def __post_init__(self):
    self.direction = direction_of(self.metric)

  def worse(self, value: float) -> bool:
    """Not finite, or worse than the best beyond the threshold."""
    return not math.isfinite(value) or (
        self.best is not None and worse_beyond(value, self.best, self.direction, self.threshold))

  def judge(self, value: float) -> str:
    """The verdict on one eval's value; updates `best` and `stale` unless it is ROLLBACK."""
    if self.worse(value):
      return ROLLBACK
    if self.best is None or better(value, self.best, self.direction):
      self.best, self.stale = value, 0
    else:
      self.stale += 1
    return STOP if self.patience and self.stale >= self.patience else CONTINUE

  def rolled_back(self) -> None:
    """Back at the best checkpoint: no eval since it has been kept."""
    self.stale = 0
