"""Distillation with every strategy at once: LogitKD + attention transfer + feature pooling +
a learned feature projection (the projection trains with the student, never exported).

  distillax train --config distillax/configs/distill_features.py --workdir runs/kd_all \
      --config.teacher.workdir=runs/teacher
  distillax train --config distillax/configs/distill_features.py:tiny --workdir runs/kd_all_tiny
"""

from distillax.configs import distill


def get_config(arg: str | None = None):
  c = distill.get_config(arg)
  c.distill.attention.weight = 0.5
  c.distill.feature_pooling.weight = 0.5
  c.distill.feature_projection.weight = 0.5
  c.distill.chunk_size = 64
  return c
