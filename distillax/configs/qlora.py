"""QLoRA: frozen nf4 base weights (tiles of 32) with trainable full-precision adapters.

  distillax train --config distillax/configs/qlora.py --workdir runs/qlora \
      --config.train.init_from=runs/lm
  distillax train --config distillax/configs/qlora.py:tiny --workdir runs/qlora_tiny
"""

from distillax.configs import lora


def get_config(arg: str | None = None):
  c = lora.get_config(arg)
  c.lora.base_qtype = "nf4"
  c.lora.base_tile_size = 32 if not arg else 16  # must divide every contracted axis (head_dim)
  return c
