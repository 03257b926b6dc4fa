"""Error text names what the user typed (issue 31, item 6): the value of a key given twice that
did not parse; the on_policy keys, not the names their values end up under; where a student of
an HF teacher comes from; one message for every conflict a check can see. And what a command
does with an earlier run: `train.init_from` takes the run's shape, a relative path to it works
from the Python API too, and extending a finished run says at start that the schedule changes.
"""

import json
import re
import shutil

import pytest

from distillax.configs import lm
from distillax.main import main
from distillax.trainers import recipe_for
from tests.test_main import LM, ROOT

ON_POLICY = f"{ROOT}/distillax/configs/on_policy.py:tiny"
DISTILL = f"{ROOT}/distillax/configs/distill.py:tiny"
# The earlier run: lm.py:tiny with a third block (the config's own model has two).
RUN_FLAGS = ["--config.model.num_layers=3", "--config.train.eval_every=0",
             "--config.optimizer.warmup_steps=1", "--config.optimizer.learning_rate=3e-4"]


def _refused(capsys, tmp_path, *argv) -> str:
  """The one error line of a train command that must fail with status 2 and write nothing."""
  capsys.readouterr()
  code = main(["distillax", "train", "--workdir", str(tmp_path / "wd"), *argv])
  captured = capsys.readouterr()
  err = captured.err.strip().splitlines()
  assert code == 2 and len(err) == 1 and err[0].startswith("distillax train: error: "), err
  assert captured.out == "" and not (tmp_path / "wd").exists()
  return err[0]


@pytest.mark.parametrize("values", [("4", "four"), ("four", "4")])
def test_a_key_given_twice_quotes_the_value_that_does_not_parse(capsys, tmp_path, values):
  line = _refused(capsys, tmp_path, "--config", f"{LM}:tiny",
                  *[f"--config.train.batch_size={v}" for v in values])
  assert "--config.train.batch_size=four must be a whole number" in line, line
  assert "batch_size=4 " not in line
