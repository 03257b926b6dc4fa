"""QLoRA: frozen nf4 base weights (tiles of 32) with trainable full-precision adapters.

  distillax train --config distillax/configs/qlora.py --workdir runs/qlora \
      --config.train.init_from=runs/lm
  distillax train --config distillax/configs/qlora.py:tiny --workdir runs/qlora_tiny
"""

from distillax.configs import lora
from distillax.configs.common import parse_arg


def get_config(arg: str | None = None):
  c = lora.get_config(arg)
  c.lora.base_qtype = "nf4"
  # Tiles must divide every contracted axis (head_dim: 16 in the tiny model).
  c.lora.base_tile_size = 16 if parse_arg(arg, tiny=False).tiny else 32
  return c
