"""Quantization-aware training: int4 weights / int8 activations fake-quantized in the forward,
straight-through backward, next-token objective. Quantization-aware *distillation* is
distillax/configs/qat_distill.py (the same `qat` section on the distill trainer).

  distillax train --config distillax/configs/qat.py --workdir runs/qat \
      --config.train.init_from=runs/lm
  distillax train --config distillax/configs/qat.py:tiny --workdir runs/qat_tiny
Other types: --config.qat.rules="(('.*', 'int8', None, None),)" or nf4 / float8_e4m3fn weights.
Progressive QAT, fp until step 100, int8 until 200, then q4_0 weights / q8_0 activations (each
stage a (first step, rules) pair; the last stage is the form eval and export use):
  distillax train --config distillax/configs/qat.py --workdir runs/qat_progressive \
      --config.qat.rules="()" --config.qat.schedule="((100, (('.*', 'int8', None, None),)), \
      (200, (('', None, None, None), ('.*', 'q4_0', 'q8_0', None))))"
"""

from distillax.configs.common import base_config, parse_arg, shrink_for_tiny
from distillax.quant import INT4_INT8_RULES


def get_config(arg: str | None = None):
  c = base_config("demo_student")
  c.trainer = "lm"
  c.qat.rules = INT4_INT8_RULES  # int4 weights, int8 activations; embedding kept fp
  c.qat.start_step = 0
  c.optimizer.learning_rate = 1e-4
  if parse_arg(arg, tiny=False).tiny:
    shrink_for_tiny(c)
    c.qat.start_step = 2  # exercise the delayed start: 2 full-precision steps first
  return c
