"""`train.loss_impl`: the values the config takes, and the one line for those it does not
(tokamax's fused loss was removed: framework/token_loss_impl.py says why)."""

import pytest

from distillax.errors import ConfigError
from distillax.framework import token_loss_impl
from distillax.main import main
from tests.test_main import LM


@pytest.mark.parametrize("value,message", [
    ("fused", "train.loss_impl='fused'; choose one of auto, chunked, sliced"),
    ("tokamax", "train.loss_impl='tokamax': it was removed (on a TPU its fused loss disagreed "
                "with the exact one by 4.9% and ran slower than 'sliced'); choose one of auto, "
                "chunked, sliced"),
])
def test_loss_impl_refusals(value, message):
  with pytest.raises(ConfigError) as e:
    token_loss_impl.check_loss_impl(value, "lm", sliced=True)
  assert str(e.value) == message
  for taken in ("auto", "chunked", "sliced"):
    token_loss_impl.check_loss_impl(taken, "lm", sliced=True)


def test_the_cli_refuses_tokamax_in_one_line_and_writes_nothing(capsys, tmp_path):
  code = main(["distillax", "train", "--workdir", str(tmp_path / "wd"), "--config", f"{LM}:tiny",
               "--config.train.loss_impl=tokamax"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and "it was removed" in err[0], err
  assert not (tmp_path / "wd").exists()
