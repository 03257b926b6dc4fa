"""TensorBoard itself (not our own reader) reads the event files a training run writes, and
metrics.jsonl is strict JSON (a diverged value is null, not NaN) that any JSON reader accepts."""

import json

import pytest

from distillax.main import main

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator")


def test_tensorboard_reads_the_runs_scalars(tmp_path):
  import os
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  workdir = tmp_path / "run"
  assert main(["distillax", "train", "--config", f"{root}/distillax/configs/lm.py:tiny",
               "--workdir", str(workdir), "--config.train.steps=4",
               "--config.train.log_every=1", "--config.train.eval_every=2"]) == 0
  acc = event_accumulator.EventAccumulator(str(workdir / "tensorboard"))
  acc.Reload()
  tags = acc.Tags()["scalars"]
  assert {"loss", "eval_loss", "learning_rate"} <= set(tags)
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  jsonl_loss = {r["step"]: r["loss"] for r in rows if "loss" in r}
  tb_loss = {e.step: e.value for e in acc.Scalars("loss")}
  assert sorted(tb_loss) == sorted(jsonl_loss) == [1, 2, 3, 4]
  for step, value in jsonl_loss.items():
    assert tb_loss[step] == pytest.approx(value, rel=1e-6)


def _strict(text: str):
  """json.loads that refuses NaN / Infinity, as JavaScript's JSON.parse and jq do."""
  def refuse(name):
    raise ValueError(f"{name} is not JSON")
  return json.loads(text, parse_constant=refuse)


def test_metrics_jsonl_stays_strict_json_when_a_value_is_not_finite(tmp_path):
  import math

  from distillax.framework.run.writers import JsonlWriter, read_jsonl
  path = tmp_path / "metrics.jsonl"
  writer = JsonlWriter(str(path))
  writer.write_scalars(1, {"loss": 2.5})
  writer.write_scalars(2, {"loss": float("nan"), "grad_norm": math.inf, "lr": -math.inf})
  writer.close()
  rows = [_strict(line) for line in path.read_text().splitlines()]
  assert rows == [{"step": 1, "loss": 2.5},
                  {"step": 2, "loss": None, "grad_norm": None, "lr": None}]
  assert read_jsonl(str(path)) == rows


def test_strict_json_helper_nulls_non_finite_values_at_any_depth(tmp_path):
  import math

  from distillax import jsonio
  value = {"a": [1.0, math.nan, {"b": (math.inf, "x", 3)}], "c": None, "d": True}
  text = jsonio.dumps(value, indent=1)
  assert _strict(text) == {"a": [1.0, None, {"b": [None, "x", 3]}], "c": None, "d": True}
  with open(tmp_path / "f.json", "w") as f:
    jsonio.dump({"x": -math.inf}, f)
  assert _strict((tmp_path / "f.json").read_text()) == {"x": None}
