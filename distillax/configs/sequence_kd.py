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

from distillax.configs import distill, sections
from distillax.configs.common import parse_arg


def get_config(arg: str | None = None):
  # The distillation config (teacher, optimizer defaults, tiny shrink) with the sequence-level
  # section in place of the logit/feature terms, which this trainer does not use.
  c = distill.get_config(arg)
  c.trainer = "sequence_kd"
  del c["distill"]
  del c["cache"]
  c.sequence_kd = sections.sequence_kd_section()
  if parse_arg(arg, tiny=False).tiny:
    c.sequence_kd.num_prompts = 16
    c.sequence_kd.prompt_len = 8
    c.sequence_kd.max_new_tokens = 40
    c.sequence_kd.batch_size = 8
  return c
