"""Sequence-level distillation: the teacher writes text, the student trains on it (lm objective).

The job samples `sequence_kd.max_new_tokens` teacher tokens after the first `prompt_len` tokens
of `num_prompts` train documents, writes them to <workdir>/teacher_samples.jsonl, then trains the
student on that file with next-token CE (eval: the validation split of data.source). Teacher from
an earlier run of distillax/configs/lm.py with the demo_teacher model:
  distillax train --config distillax/configs/sequence_kd.py --workdir runs/seqkd \
      --config.teacher.workdir=runs/teacher
Greedy decoding instead of sampling, and more samples:
  distillax train --config distillax/configs/sequence_kd.py --workdir runs/seqkd_greedy \
      --config.teacher.workdir=runs/teacher --config.sequence_kd.temperature=0 \
      --config.sequence_kd.num_prompts=1024
A seconds-long run with a fresh tiny teacher:
  distillax train --config distillax/configs/sequence_kd.py:tiny --workdir runs/seqkd_tiny
"""

from distillax.configs.common import base_config, shrink_for_tiny
from distillax.distill.sequence_kd import default_sequence_kd_config
from distillax.trainers.distill import default_teacher_config


def get_config(arg: str | None = None):
  c = base_config("demo_student")
  c.trainer = "sequence_kd"
  c.teacher = default_teacher_config()
  c.sequence_kd = default_sequence_kd_config()
  # The distillation defaults: AdamW with weight decay 0.1, clipping at 1.0, warmup + cosine.
  c.optimizer.weight_decay = 0.1
  c.optimizer.grad_clip_norm = 1.0
  c.optimizer.schedule = "warmup_cosine"
  if arg == "tiny":
    shrink_for_tiny(c)
    c.teacher.preset = "tiny"
    c.model.num_layers = 1
    c.sequence_kd.num_prompts = 16
    c.sequence_kd.prompt_len = 8
    c.sequence_kd.max_new_tokens = 40
    c.sequence_kd.batch_size = 8
  elif arg:
    raise ValueError(f"unknown config argument {arg!r}; use ':tiny' or nothing")
  return c
