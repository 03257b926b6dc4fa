"""A run's first eval is compiled while the run starts (trainers/eval_ahead.py): a tiny
distillation run's eval (the teacher's metrics among its figures) compiles nothing at its step,
and reports the numbers of the same run whose eval compiled its own programs."""

import pytest

from distillax.configs import distill as distill_config
from distillax.trainers import Trainer, base, recipe_for
from distillax.trainers.eval_ahead import first_eval_step
from tests.support.compiles import Compiles

_EVALUATE = Trainer._evaluate


def _run(workdir, monkeypatch) -> tuple[dict, list[list[str]]]:
  """(summary, the programs the main thread compiled inside each eval) of a 2-step tiny
  distillation run evaluated at its end over 2 batches."""
  config = distill_config.get_config("tiny")
  config.train.steps, config.train.eval_every, config.train.eval_batches = 2, 0, 2
  config.optimizer.warmup_steps, config.checkpoint.async_save = 1, False
  compiled = []

  def counted(self, state, step):
    with Compiles() as inside:
      out = _EVALUATE(self, state, step)
    compiled.append(inside.main_names)
    return out
  monkeypatch.setattr(Trainer, "_evaluate", counted)
  return Trainer(recipe_for(config), str(workdir)).run(), compiled


def test_the_first_eval_compiles_nothing_and_reports_the_same_figures(tmp_path, monkeypatch):
  ahead, ahead_compiles = _run(tmp_path / "ahead", monkeypatch)
  monkeypatch.setattr(base, "compile_first_eval", lambda *args: None)
  plain, plain_compiles = _run(tmp_path / "plain", monkeypatch)
  assert ahead_compiles == [[]], ahead_compiles
  assert any(name and "traced" in name for name in plain_compiles[0]), plain_compiles
  figures = lambda summary: {k: v for k, v in summary.items() if k.startswith("eval_")}
  assert "eval_teacher_ce" in figures(ahead)
  assert figures(ahead) == figures(plain)


@pytest.mark.parametrize("start, every, want", [(0, 3, 3), (3, 3, 6), (4, 3, 6), (9, 3, 10),
                                                (0, 0, 10), (7, 0, 10), (10, 3, None)])
def test_first_eval_step(start, every, want):
  config = distill_config.get_config("tiny")
  config.train.steps, config.train.eval_every = 10, every
  assert first_eval_step(config, start) == want
