"""LoRA: rank-8 adapters on the attention and MLP matmuls; only adapters train and hold
optimizer state. QLoRA is distillax/configs/qlora.py.

  distillax train --config distillax/configs/lora.py --workdir runs/lora \
      --config.train.init_from=runs/lm
  distillax train --config distillax/configs/lora.py:tiny --workdir runs/lora_tiny
"""

from distillax.configs.common import base_config, parse_arg, shrink_for_tiny


def get_config(arg: str | None = None):
  c = base_config("demo_student")
  c.trainer = "lm"
  # "layers/0/attn/q" with unrolled layers, "layers/attn/q" under model.scan_layers=True
  c.lora.module_regex = r"layers/(.*/)?(attn|mlp)/.*"
  c.optimizer.learning_rate = 1e-3
  if parse_arg(arg, tiny=False).tiny:
    shrink_for_tiny(c)
  return c
