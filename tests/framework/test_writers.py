"""TensorBoard itself (not our own reader) reads the event files a training run writes."""

import pytest

from distillax.main import main

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator")


def test_tensorboard_reads_the_runs_scalars(tmp_path):
  import json
  import os
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
