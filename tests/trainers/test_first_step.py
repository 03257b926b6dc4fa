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

import jax
import pytest

from distillax.configs import lm as lm_config
from distillax.framework.backends import STEP_NAME
from distillax.trainers import Trainer, recipe_for
from tests.framework.run.test_compile_cache import no_user_cache  # noqa: F401 - a fixture

COMPILE = "/jax/core/compile/backend_compile_duration"  # every compile request, hit or not
HIT, MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"
PHASES = ("imports, config and runtime", "devices", "sources, mesh and tokenizer", "checks",
          "step lowering",
          "data", "models", "waiting for the step's compile", "memory and workdir", "metrics",
          "first batch", "first step")


class _Compiles:
  """The programs compiled while inside (by name), and the persistent cache's hits and misses."""

  def __enter__(self):
    self.names, self.events = [], []
    self._on_event = lambda event, **kw: self.events.append(event)
    self._on_duration = (lambda event, seconds, **kw: self.names.append(kw.get("fun_name"))
                         if event == COMPILE else None)
    jax.monitoring.register_event_listener(self._on_event)
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_listener(self._on_event)
    jax.monitoring.unregister_event_duration_listener(self._on_duration)


def test_the_step_compiles_once_and_the_resumed_run_compiles_nothing(tmp_path, caplog,
                                                                     no_user_cache):  # noqa: F811
  config = lm_config.get_config("tiny")
  config.train.steps, config.train.eval_every, config.optimizer.warmup_steps = 2, 0, 1
  config.checkpoint.every_steps, config.checkpoint.async_save = 1, False
  with _Compiles() as first, caplog.at_level(logging.INFO):
    Trainer(recipe_for(config), str(tmp_path)).run()
  assert first.names.count(f"jit({STEP_NAME})") == 1, first.names
  cached = os.listdir(tmp_path / "compile_cache")
  assert any(name.startswith(f"jit_{STEP_NAME}-") for name in cached), cached
  assert first.events.count(MISS) == len(cached)  # every program compiled was written

  lines = [r.getMessage() for r in caplog.records if "since the process started" in r.getMessage()]
  assert len(lines) == 1 and lines[0].startswith("step 1 at "), lines
  head, body = lines[0].split(";")[0].split(": ", 1)
  phases = dict(re.findall(r"(?:^|, )([a-z'][a-z' ,]*?) (\d+\.\d) s", body))
  assert tuple(phases) == PHASES, lines[0]
  total = float(re.match(r"step 1 at (\d+\.\d) s", head).group(1))
  # The parts are the whole, each rounded to 0.1 s.
  assert abs(sum(float(v) for v in phases.values()) - total) <= 0.05 * (len(phases) + 1) + 0.1
  assert re.search(r"the step compiled in \d+\.\d s beside them$", lines[0])

  # As if killed after step 1's checkpoint: the same job (the same programs) resumes from there.
  shutil.rmtree(tmp_path / "checkpoints" / "2")
  os.remove(tmp_path / "summary.json")
  with _Compiles() as resumed:
    summary = Trainer(recipe_for(config), str(tmp_path)).run()
  assert summary["step"] == 2 and summary["finished"]
  assert f"jit({STEP_NAME})" in resumed.names, resumed.names
  assert resumed.events.count(MISS) == 0, resumed.names
  assert resumed.events.count(HIT) == len(resumed.names), resumed.names
  assert sorted(os.listdir(tmp_path / "compile_cache")) == sorted(cached)
