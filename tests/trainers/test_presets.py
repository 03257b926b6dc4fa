"""Distillation, QAT and (Q)LoRA train from their configs under every partitioning preset."""

import json
import os

import numpy as np
import pytest

from distillax.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = ("distill_features", "qat_distill", "lora", "qlora")
PRESETS = (("dp", 8, 1), ("fsdp", 8, 1), ("tp", 4, 2), ("fsdp_tp", 4, 2))


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("strategy,data,model", PRESETS)
def test_config_trains_under_preset(config, strategy, data, model, tmp_path):
  workdir = tmp_path / "run"
  code = main(["distillax", "train", "--config", f"{ROOT}/distillax/configs/{config}.py:tiny",
               "--workdir", str(workdir), "--config.train.steps=2",
               "--config.train.eval_every=2", "--config.train.log_every=1",
               "--config.optimizer.warmup_steps=1",
               f"--config.partitioning.strategy={strategy}", f"--config.mesh.data={data}",
               f"--config.mesh.model={model}", "--config.checkpoint.every_steps=0"])
  assert code == 0
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 2 and np.all(np.isfinite(losses))
  assert np.isfinite([r["eval_loss"] for r in rows if "eval_loss" in r]).all()
