"""Quantization-aware distillation: a fake-quant int4/int8 student learns from a teacher.

  distillax train --config distillax/configs/qat_distill.py --workdir runs/qat_kd \
      --config.teacher.workdir=runs/teacher --config.train.init_from=runs/kd
  distillax train --config distillax/configs/qat_distill.py:tiny --workdir runs/qat_kd_tiny
"""

from distillax.configs import distill
from distillax.configs.common import parse_arg
from distillax.quant import INT4_INT8_RULES


def get_config(arg: str | None = None):
  c = distill.get_config(arg)
  c.qat.rules = INT4_INT8_RULES  # int4 weights, int8 activations; embedding kept fp
  if not parse_arg(arg, tiny=False).tiny:
    c.optimizer.learning_rate = 1e-4
  return c
