"""The main job (`distillax demo`, `make demo`): pretrain a teacher, train a student from
scratch, distil it, quantization-aware distil it to int4/int8 and PTQ it for comparison, export
the int4 student, report.

Each trained stage is an ordinary distillax run in its own workdir under the demo workdir
(stages.py); the demo is a job of its own, not a recipe: it runs five of them, then the report.
"""

from __future__ import annotations

import os

from absl import logging

from distillax.demo.report import build_report
from distillax.demo.stages import TRAINED_STAGES, stage_config, stage_finished
from distillax.errors import UserError
from distillax.trainers import Trainer, recipe_for

class DemoPipeline:
  """Runs the stages in order (reusing finished ones), then writes the report."""

  def __init__(self, config, workdir: str):
    self.config = config
    self.workdir = os.path.abspath(workdir)

  def stage_dir(self, stage: str) -> str:
    return os.path.join(self.workdir, stage)

  def run(self) -> dict:
    configs = {s: stage_config(self.config, s, self.workdir) for s in TRAINED_STAGES}
    for stage in TRAINED_STAGES:  # validate every stage before the first one trains
      configs[stage].lock()
    os.makedirs(self.workdir, exist_ok=True)
    with open(os.path.join(self.workdir, "config.json"), "w") as f:
      f.write(self.config.to_json_best_effort(indent=2, sort_keys=True))
    for i, stage in enumerate(TRAINED_STAGES, 1):
      sdir = self.stage_dir(stage)
      if stage_finished(sdir):
        print(f"[demo {i}/{len(TRAINED_STAGES)}] {stage}: finished earlier, reusing {sdir}")
        continue
      print(f"[demo {i}/{len(TRAINED_STAGES)}] {stage}: training ({configs[stage].train.steps} "
            f"steps) in {sdir}", flush=True)
      Trainer(recipe_for(configs[stage], workdir=sdir), sdir).run()
      logging.info("demo stage %s done", stage)
    report = build_report(self)
    return {"finished": True, **{f"{k}_val_loss": v["val_loss"]
                                 for k, v in report["stages"].items()}}


def run_demo(config, workdir: str | None) -> int:
  """`distillax demo`: every stage, then the report; returns 0."""
  if not workdir:
    raise UserError("--workdir is required for demo, e.g. --workdir runs/demo")
  if "job" not in config or config.job != "demo":
    raise UserError("distillax demo runs the demo's config; use --config "
                    "distillax/configs/demo.py (or demo.py:tiny)")
  DemoPipeline(config, workdir).run()
  return 0
