"""Quantization-aware distillation: a fake-quant int4/int8 student learns from a teacher.

  distillax train --config distillax/configs/qat_distill.py --workdir runs/qat_kd \
      --config.teacher.workdir=runs/teacher --config.train.init_from=runs/kd
  distillax train --config distillax/configs/qat_distill.py:tiny --workdir runs/qat_kd_tiny
"""

from distillax.configs import distill


def get_config(arg: str | None = None):
  c = distill.get_config(arg)
  c.qat.rules = (("", None, None, None), (".*", "int4", "int8", None))  # embedding kept fp
  c.optimizer.learning_rate = 1e-4 if not arg else c.optimizer.learning_rate
  return c
