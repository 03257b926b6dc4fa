"""From `distillax train` starting to its first step (issue 45). The step whose memory figures the
loop reads and logs before training is the step that runs: compiled once. Every program of the
run lands in <workdir>/compile_cache, and the run resumed there compiles none of them (JAX's
monitoring events: every compile request is a persistent-cache hit, none a miss). The first
step's log line names where the time went.

The resumed run has the same train.steps: the learning-rate schedule is part of the step, so a
run extended to more steps compiles a new step (once, and keeps it)."""

import logging
import os
import re
import shutil

import pytest

from distillax.configs import lm as lm_config
from distillax.framework.backends import STEP_NAME
from distillax.framework.run import runtime
from distillax.main import main
from distillax.trainers import Trainer, recipe_for
from tests.framework.run.test_compile_cache import no_user_cache  # noqa: F401 - a fixture
from tests.support.compiles import HIT, MISS, Compiles

LM = os.path.join(os.path.dirname(lm_config.__file__), "lm.py")
PHASES = ("imports, config and runtime", "devices", "sources, mesh and tokenizer", "checks",
          "step lowering",
          "data", "models", "waiting for the step's compile", "memory and workdir", "metrics",
          "first batch", "first step")


def _phases(line: str) -> dict[str, float]:
  """The phases of a first-step line, checked to add up to its 'step 1 at' figure."""
  head, body = line.split(";")[0].split(": ", 1)
  phases = {k: float(v) for k, v in re.findall(r"(?:^|, )([a-z'][a-z' ,]*?) (\d+\.\d) s", body)}
  total = float(re.match(r"step 1 at (\d+\.\d) s", head).group(1))
  # The parts are the whole, each rounded to 0.1 s.
  assert abs(sum(phases.values()) - total) <= 0.05 * (len(phases) + 1) + 0.1, line
  return phases


def test_the_step_compiles_once_and_the_resumed_run_compiles_nothing(tmp_path, caplog,
                                                                     no_user_cache):  # noqa: F811
  config = lm_config.get_config("tiny")
  config.train.steps, config.train.eval_every, config.optimizer.warmup_steps = 2, 0, 1
  config.checkpoint.every_steps, config.checkpoint.async_save = 1, False
  with Compiles() as first, caplog.at_level(logging.INFO):
    Trainer(recipe_for(config), str(tmp_path)).run()
  assert first.names.count(f"jit({STEP_NAME})") == 1, first.names
  cached = os.listdir(tmp_path / "compile_cache")
  assert any(name.startswith(f"jit_{STEP_NAME}-") for name in cached), cached
  assert first.events.count(MISS) == len(cached)  # every program compiled was written

  lines = [r.getMessage() for r in caplog.records if "since the process started" in r.getMessage()]
  assert len(lines) == 1 and lines[0].startswith("step 1 at "), lines
  assert tuple(_phases(lines[0])) == PHASES, lines[0]
  assert re.search(r"; the step compiled in \d+\.\d s beside them$", lines[0])

  # As if killed after step 1's checkpoint: the same job (the same programs) resumes from there.
  shutil.rmtree(tmp_path / "checkpoints" / "2")
  os.remove(tmp_path / "summary.json")
  with Compiles() as resumed:
    summary = Trainer(recipe_for(config), str(tmp_path)).run()
  assert summary["step"] == 2 and summary["finished"]
  assert f"jit({STEP_NAME})" in resumed.names, resumed.names
  assert resumed.events.count(MISS) == 0, resumed.names
  assert resumed.events.count(HIT) == len(resumed.names), resumed.names
  assert sorted(os.listdir(tmp_path / "compile_cache")) == sorted(cached)


def test_under_the_cli_the_devices_open_while_the_modules_import(tmp_path, capsys, monkeypatch):
  """`distillax train` starts JAX's backends in a thread as soon as JAX is imported (main.py,
  cli/devices.py): the line's devices phase is then the wait for that thread, and how long the
  devices took to open is said beside the phases, with the step's compile."""
  for name in runtime.DISTRIBUTED_ENV:  # one process, as a user starts it
    monkeypatch.delenv(name, raising=False)
  argv = ["distillax", "train", "--config", f"{LM}:tiny", "--workdir", str(tmp_path),
          "--config.train.steps=2", "--config.train.eval_every=0",
          "--config.optimizer.warmup_steps=1"]
  assert main(argv) == 0
  lines = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()
           if "since the process started" in line]
  assert len(lines) == 1, lines
  assert tuple(_phases(lines[0])) == tuple(
      "waiting for the devices" if p == "devices" else p for p in PHASES), lines[0]
  assert re.search(r"; the devices opened in \d+\.\d s and the step compiled in \d+\.\d s "
                   r"beside them$", lines[0]), lines[0]
