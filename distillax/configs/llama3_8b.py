"""Next-token training at Llama 3.1 8B shapes: for `distillax plan` on simulated devices (or a pod).

Size it on a laptop, never materialising a parameter:
  distillax plan --config distillax/configs/llama3_8b.py --devices 64 --memory_gb 95
  distillax plan --config distillax/configs/llama3_8b.py --devices 64 --memory_gb 95 \
      --config.partitioning.strategy=fsdp_tp --config.mesh.model=8
Train (on real hardware):
  distillax train --config distillax/configs/llama3_8b.py --workdir runs/llama8b
"""

from distillax.configs.common import base_config, model_config, parse_arg, shrink_for_tiny


def get_config(arg: str | None = None):
  c = base_config()
  c.trainer = "lm"
  c.model = model_config("llama3.1-8b", param_dtype="float32", dtype="bfloat16", remat="full")
  c.partitioning.strategy = "fsdp"
  c.train.batch_size = 64
  c.train.seq_len = 2048
  c.train.steps = 1000
  c.optimizer.warmup_steps = 100
  if parse_arg(arg, tiny=False).tiny:
    shrink_for_tiny(c)
    c.model.vocab_size = 0
  return c
