"""The demo's trained stages: each an ordinary distillax job config, built from the demo config.

A finished stage is reused and an unfinished one resumes from its checkpoints, so rerunning the
demo continues where it stopped. Whether a stage directory holds *this* stage is the workdir's
job identity, as for every run (trainers/workdir.py): a stage made by another demo config (the
tiny one, say) is refused, never reused.
"""

from __future__ import annotations

import os

import ml_collections

from distillax.configs import sections
from distillax.configs.common import base_config
from distillax.demo import draft, on_policy
from distillax.trainers.workdir import check_workdir

# The quantized stage keeps its name student_qat_int4 (and the report its PTQ row
# student_ptq_int4): q4_0 is a 4-bit integer block format, and workdirs and readers of
# report.json keep their keys.
# student_kd_fp: the distilled student trained on, in full precision, for as many extra steps as
# QAT takes: the fair source of the PTQ baseline and the full-precision reference of the QAT
# recovery ratio (QAT must not win merely by training longer).
# student_onpolicy and student_qad_q4_0 (demo/on_policy.py): the same extra steps on the
# student's own samples, full precision and q4_0.
# student_qat_progressive: the same extra steps with the bit-width stepped down (`progressive_qat`,
# a qat.schedule: fp, then int8, then q4_0), against student_qat_int4's q4_0 from the first step.
TRAINED_STAGES = ("teacher", "student_scratch", "student_kd", "student_kd_fp",
                  "student_qat_int4", "student_qat_progressive", *on_policy.STAGES)
# QAT and its fp twin again under other seeds (`qat_seeds` > 1): the recovery ratio is a ratio
# of two small loss gaps, so the report states its spread over seeds.
SEED_STAGES = ("student_kd_fp", "student_qat_int4")


def seed_stage(stage: str, k: int) -> str:
  """The stage name of `stage` (one of SEED_STAGES) under the demo's seed + k (k >= 1)."""
  return f"{stage}_seed{k}"


def all_stages(demo: ml_collections.ConfigDict) -> tuple[str, ...]:
  """Every trained stage of this demo config, in training order: the students' rows, the
  draft head for the teacher (demo/draft.py), the extra seeds."""
  extra = tuple(seed_stage(s, k) for k in range(1, int(demo.get("qat_seeds", 1)))
                for s in SEED_STAGES)
  return TRAINED_STAGES + draft.STAGES + extra


def _copy_common(c: ml_collections.ConfigDict, demo: ml_collections.ConfigDict) -> None:
  c.seed = demo.seed
  c.backend = demo.backend
  c.mesh = demo.mesh.copy_and_resolve_references()
  c.partitioning = demo.partitioning.copy_and_resolve_references()
  c.data = demo.data.copy_and_resolve_references()
  c.optimizer = demo.optimizer.copy_and_resolve_references()
  for key in ("batch_size", "seq_len", "eval_every", "eval_batches", "log_every", "progress",
              "export_format"):
    c.train[key] = demo.train[key]
  c.checkpoint.every_steps = demo.checkpoint.every_steps


def stage_config(demo: ml_collections.ConfigDict, stage: str, workdir: str
                 ) -> ml_collections.ConfigDict:
  """The full job config of one trained stage of the demo."""
  base, _, k = stage.partition("_seed")
  if k:
    c = stage_config(demo, base, workdir)
    c.seed = int(demo.seed) + int(k)
    return c
  c = base_config()
  _copy_common(c, demo)
  if stage == "teacher":
    c.trainer = "lm"
    c.model = demo.teacher_model.copy_and_resolve_references()
    c.train.steps = demo.teacher_steps
    c.optimizer.learning_rate = demo.teacher_learning_rate
    return c
  if stage in draft.STAGES:
    return draft.stage_config(c, demo, workdir)
  c.model = demo.student_model.copy_and_resolve_references()
  c.train.steps = demo.student_steps
  if stage == "student_scratch":
    c.trainer = "lm"
    return c
  c.trainer = "distill"
  c.teacher = sections.teacher_section()
  c.teacher.workdir = os.path.join(workdir, "teacher")
  c.distill = sections.distill_section()
  c.distill.update(demo.distill.copy_and_resolve_references())
  if stage == "student_kd":
    return c
  if stage in ("student_kd_fp", "student_qat_int4", "student_qat_progressive"):
    c.train.steps = demo.qat_steps
    c.train.init_from = os.path.join(workdir, "student_kd")
    c.optimizer.learning_rate = demo.qat_learning_rate
    c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, max(demo.qat_steps // 10, 1))
    if stage == "student_qat_int4":
      c.qat.rules = tuple(demo.quant_rules)
    if stage == "student_qat_progressive":
      c.qat.schedule = tuple(demo.progressive_qat)
    return c
  if stage in on_policy.STAGES:
    if stage == "student_qad_q4_0":
      c.qat.rules = tuple(demo.quant_rules)
    return on_policy.stage_config(c, demo, workdir)
  raise ValueError(f"unknown demo stage {stage!r}")


def stage_finished(stage: str, stage_dir: str, config: ml_collections.ConfigDict) -> bool:
  """Whether `stage_dir` holds this stage finished (to reuse); False for one to train or resume.
  A stage directory of another job (another demo config's stage) is a UserError."""
  owner = f"demo stage {stage} ({stage_dir})"
  return check_workdir(stage_dir, config, owner=owner).finished


