"""The main job: pretrain a teacher, train a student from scratch, distil it, quantization-aware
distil it to int4/int8 and PTQ it for comparison, export the int4 student, report.

Each trained stage is an ordinary distillax run in its own workdir under the demo workdir, built
from the demo config by `stage_config`; a finished stage (its summary.json says so) is reused and
an unfinished one resumes from its checkpoints, so rerunning the demo continues where it stopped.
"""

from __future__ import annotations

import json
import os

import ml_collections
from absl import logging

from distillax.configs.common import base_config
from distillax.trainers.base import SUMMARY_FILE

# student_kd_fp: the distilled student trained on, in full precision, for as many extra steps as
# QAT takes: the fair source of the PTQ baseline and the full-precision reference of the QAT
# recovery ratio (QAT must not win merely by training longer).
TRAINED_STAGES = ("teacher", "student_scratch", "student_kd", "student_kd_fp",
                  "student_qat_int4")

def _copy_common(c: ml_collections.ConfigDict, demo: ml_collections.ConfigDict) -> None:
  c.seed = demo.seed
  c.backend = demo.backend
  c.mesh = demo.mesh.copy_and_resolve_references()
  c.partitioning = demo.partitioning.copy_and_resolve_references()
  c.data = demo.data.copy_and_resolve_references()
  c.optimizer = demo.optimizer.copy_and_resolve_references()
  for key in ("batch_size", "seq_len", "eval_every", "eval_batches", "log_every", "progress"):
    c.train[key] = demo.train[key]
  c.checkpoint.every_steps = demo.checkpoint.every_steps


def stage_config(demo: ml_collections.ConfigDict, stage: str, workdir: str
                 ) -> ml_collections.ConfigDict:
  """The full job config of one trained stage of the demo."""
  from distillax.trainers.distill import default_distill_config, default_teacher_config
  c = base_config()
  _copy_common(c, demo)
  if stage == "teacher":
    c.trainer = "lm"
    c.model = demo.teacher_model.copy_and_resolve_references()
    c.train.steps = demo.teacher_steps
    c.optimizer.learning_rate = demo.teacher_learning_rate
    return c
  c.model = demo.student_model.copy_and_resolve_references()
  c.train.steps = demo.student_steps
  if stage == "student_scratch":
    c.trainer = "lm"
    return c
  c.trainer = "distill"
  c.teacher = default_teacher_config()
  c.teacher.workdir = os.path.join(workdir, "teacher")
  c.distill = default_distill_config()
  c.distill.update(demo.distill.copy_and_resolve_references())
  if stage == "student_kd":
    return c
  if stage in ("student_kd_fp", "student_qat_int4"):
    c.train.steps = demo.qat_steps
    c.train.init_from = os.path.join(workdir, "student_kd")
    c.optimizer.learning_rate = demo.qat_learning_rate
    c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, max(demo.qat_steps // 10, 1))
    if stage == "student_qat_int4":
      c.qat.rules = tuple(tuple(r) for r in demo.quant_rules)
    return c
  raise ValueError(f"unknown demo stage {stage!r}")


def stage_finished(stage_dir: str) -> bool:
  path = os.path.join(stage_dir, SUMMARY_FILE)
  if not os.path.exists(path):
    return False
  with open(path) as f:
    return bool(json.load(f).get("finished"))


class DemoPipeline:
  """Runs the stages in order (reusing finished ones), then writes the report."""

  name = "demo"

  def __init__(self, config, workdir: str):
    self.config = config
    self.workdir = os.path.abspath(workdir)

  def stage_dir(self, stage: str) -> str:
    return os.path.join(self.workdir, stage)

  def run(self) -> dict:
    from distillax.trainers import get_trainer
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
      get_trainer(configs[stage].trainer)(configs[stage], sdir).run()
      logging.info("demo stage %s done", stage)
    from distillax.demo.report import build_report
    report = build_report(self)
    return {"finished": True, **{f"{k}_val_loss": v["val_loss"]
                                 for k, v in report["stages"].items()}}
