"""Distillation, QAT and (Q)LoRA under every partitioning preset.

tests/test_main.py trains every config for a few steps under its default preset (fsdp); here each
of these configs compiles its step, with real shardings, under the other presets: compiling is
where a preset that cannot place a parameter or an activation fails. (That every preset then
computes the same numbers is tests/framework/test_engine_equivalence.py.)
"""

import importlib

import jax
import pytest

from distillax.trainers import get_trainer

CONFIGS = ("distill_features", "qat_distill", "lora", "qlora")
PRESETS = {"dp": (8, 1), "tp": (4, 2), "fsdp_tp": (4, 2)}  # fsdp: trained in test_main


@pytest.mark.parametrize("strategy", PRESETS)
@pytest.mark.parametrize("config", CONFIGS)
def test_config_compiles_under_preset(config, strategy, tmp_path):
  c = importlib.import_module(f"distillax.configs.{config}").get_config("tiny")
  assert c.partitioning.strategy == "fsdp"  # the default that test_main trains under
  c.partitioning.strategy = strategy
  c.mesh.data, c.mesh.model = PRESETS[strategy]
  trainer = get_trainer(c.trainer)(c, str(tmp_path))
  trainer.setup(with_data=False)
  specs = [s.spec for s in jax.tree.leaves(trainer.engine.layout.shardings.params)]
  if strategy == "dp":
    assert all(all(a is None for a in spec) for spec in specs)
  else:
    assert any("model" in [a for a in spec] for spec in specs)
  assert trainer.engine.runner.stats.get("flops", 0) > 0
