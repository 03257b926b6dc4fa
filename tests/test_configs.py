"""Every job config in distillax/configs: its docstring names its launch command, and its `:tiny`
trains a few steps from the CLI. A file of its own (not test_main.py), so the two test workers
can split it from the demo's long test."""

import glob
import json
import os

import pytest

from distillax.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Job configs are the files with a get_config (common.py and sections.py are their parts).
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "distillax", "configs", "*.py"))
                 if "def get_config(" in open(p).read())
DEMO = os.path.join(ROOT, "distillax", "configs", "demo.py")
JOBS = [p for p in CONFIGS if p != DEMO]


def test_every_config_has_its_launch_command_in_the_docstring():
  for path in CONFIGS:
    source = open(path).read()
    name = os.path.relpath(path, ROOT)
    assert f"--config {name}" in source, f"{name}: docstring lacks its launch command"


@pytest.mark.parametrize("config", JOBS, ids=os.path.basename)
def test_every_config_trains_on_tiny_overrides(config, tmp_path):
  workdir = tmp_path / "run"
  code = main(["distillax", "train", "--config", f"{config}:tiny", "--workdir", str(workdir),
               "--config.train.steps=3", "--config.train.eval_every=3"])
  assert code == 0
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert any("loss" in r for r in rows) and any("eval_loss" in r for r in rows)
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["step"] == 3 and summary["finished"]
  assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 3
