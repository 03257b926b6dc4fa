"""Next-token training of one model on the embedded corpus (or any text via data.source).

Launch:
  distillax train --config distillax/configs/lm.py --workdir runs/lm
  distillax train --config distillax/configs/lm.py:tiny --workdir runs/lm_tiny
"""

from distillax.configs.common import base_config, parse_arg, shrink_for_tiny


def get_config(arg: str | None = None):
  c = base_config("demo_student")
  c.trainer = "lm"
  if parse_arg(arg, tiny=False).tiny:
    shrink_for_tiny(c)
  return c
