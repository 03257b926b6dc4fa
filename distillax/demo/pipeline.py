"""The main job (`distillax demo`, `make demo`): pretrain a teacher, train a student from
scratch, distil it, quantization-aware distil it to llama.cpp's q4_0 (q8_0 activations) and PTQ
it for comparison, export the students as GGUF and run them in llama.cpp, report.

Each trained stage is an ordinary distillax run in its own workdir under the demo workdir
(stages.py); the demo is a job of its own, not a recipe: it runs five of them, then the report.
"""

from __future__ import annotations

import os
import sys

from absl import logging

from distillax.demo.report import build_report
from distillax.demo.stages import all_stages, stage_config, stage_finished
from distillax.errors import UserError
from distillax.framework.run.preemption import STOPPED_EXIT_CODE
from distillax.trainers import Trainer, recipe_for
from distillax.trainers.workdir import CONFIG_FILE, workdir_job


class DemoPipeline:
  """Runs the stages in order (reusing finished ones), then writes the report."""

  def __init__(self, config, workdir: str):
    self.config = config
    self.workdir = os.path.abspath(workdir)

  def stage_dir(self, stage: str) -> str:
    return os.path.join(self.workdir, stage)

  def _check(self) -> tuple[dict, dict[str, bool]]:
    """Every stage's config and directory, before anything is written: the stage configs and
    which stages are finished."""
    stages = all_stages(self.config)
    configs = {s: stage_config(self.config, s, self.workdir) for s in stages}
    for stage in stages:
      configs[stage].lock()
    if workdir_job(self.workdir) not in (None, "demo"):
      raise UserError(f"{os.path.join(self.workdir, CONFIG_FILE)} is not a demo's (it is another "
                      f"run's workdir); pass a new --workdir for the demo")
    return configs, {s: stage_finished(s, self.stage_dir(s), configs[s]) for s in stages}

  def run(self) -> dict:
    """{"finished": True, <stage>_val_loss...} after the report, or {"finished": False, "stage",
    "step", "total_steps"} when a signal stopped a stage (saved; rerunning resumes it)."""
    configs, finished = self._check()
    os.makedirs(self.workdir, exist_ok=True)
    with open(os.path.join(self.workdir, CONFIG_FILE), "w") as f:
      f.write(self.config.to_json_best_effort(indent=2, sort_keys=True))
    for i, stage in enumerate(configs, 1):
      sdir = self.stage_dir(stage)
      if finished[stage]:
        print(f"[demo {i}/{len(configs)}] {stage}: finished earlier, reusing {sdir}")
        continue
      print(f"[demo {i}/{len(configs)}] {stage}: training "
            f"({configs[stage].train.steps} steps) in {sdir}", flush=True)
      summary = Trainer(recipe_for(configs[stage], workdir=sdir), sdir).run()
      if not summary.get("finished"):
        return {"finished": False, "stage": stage, "step": summary.get("step"),
                "total_steps": int(configs[stage].train.steps)}
      logging.info("demo stage %s done", stage)
    report = build_report(self)
    return {"finished": True, **{f"{k}_val_loss": v["val_loss"]
                                 for k, v in report["stages"].items()}}


def run_demo(config, workdir: str | None) -> int:
  """`distillax demo`: every stage, then the report; returns 0, or STOPPED_EXIT_CODE when a
  signal (SIGTERM, Ctrl-C) stopped it (what was trained is saved)."""
  if not workdir:
    raise UserError("--workdir is required for demo, e.g. --workdir runs/demo")
  if "job" not in config or config.job != "demo":
    raise UserError("distillax demo runs the demo's config; use --config "
                    "distillax/configs/demo.py (or demo.py:tiny)")
  try:
    result = DemoPipeline(config, workdir).run()
  except KeyboardInterrupt:  # outside a stage's steps (there, Ctrl-C saves and stops)
    print("distillax demo: interrupted; rerun the same command to resume", file=sys.stderr,
          flush=True)
    return STOPPED_EXIT_CODE
  if not result["finished"]:
    print(f"distillax demo: stopped at step {result['step']} of {result['total_steps']} "
          f"(stage {result['stage']}); rerun the same command to resume", flush=True)
    return STOPPED_EXIT_CODE
  return 0
