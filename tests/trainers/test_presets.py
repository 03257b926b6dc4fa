"""Distillation, QAT and (Q)LoRA under every partitioning preset.

Each config trains for real under one preset (rotating, so every preset and every config
trains once) and compiles its step, with real shardings, under the other three: compiling is
where a preset that cannot place a parameter or an activation fails, and it keeps the suite fast.
"""

import importlib
import json
import os

import jax
import numpy as np
import pytest

from distillax.main import main
from distillax.trainers import get_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = ("distill_features", "qat_distill", "lora", "qlora")
PRESETS = {"dp": (8, 1), "fsdp": (8, 1), "tp": (4, 2), "fsdp_tp": (4, 2)}
TRAINED = dict(zip(CONFIGS, PRESETS))  # distill_features/dp, qat_distill/fsdp, lora/tp, ...


@pytest.mark.parametrize("config", CONFIGS)
def test_config_trains_under_its_preset(config, tmp_path):
  strategy = TRAINED[config]
  data, model = PRESETS[strategy]
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


OTHERS = [(c, s) for c in CONFIGS for s in PRESETS if TRAINED[c] != s]


@pytest.mark.parametrize("config,strategy", OTHERS)
def test_config_compiles_under_every_other_preset(config, strategy, tmp_path):
  c = importlib.import_module(f"distillax.configs.{config}").get_config("tiny")
  c.partitioning.strategy = strategy
  c.mesh.data, c.mesh.model = PRESETS[strategy]
  trainer = get_trainer(c.trainer)(c, str(tmp_path))
  trainer.setup(with_data=False)
  shardings = trainer.engine.layout.shardings
  specs = [s.spec for s in jax.tree.leaves(shardings.params)]
  if strategy == "dp":
    assert all(all(a is None for a in spec) for spec in specs)
  else:  # something is actually sharded
    assert any(any(a is not None for a in spec) for spec in specs)
  assert trainer.engine.runner.stats.get("flops", 0) > 0
