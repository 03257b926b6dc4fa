"""Knowledge distillation of the demo student from a teacher (LogitKD by default).

Launch (teacher from an earlier run of distillax/configs/lm.py with the demo_teacher model):
  distillax train --config distillax/configs/distill.py --workdir runs/kd \
      --config.teacher.workdir=runs/teacher
Other strategies are weights in the `distill` section, e.g. attention transfer and features:
  distillax train --config distillax/configs/distill.py --workdir runs/kd_att \
      --config.distill.attention.weight=1 --config.distill.feature_pooling.weight=0.5
The student starts from fresh weights unless the `student` section names a Hugging Face
checkpoint (--config.student.hf_path=DIR) or teacher blocks to copy
(--config.student.from_teacher.layers="(0, 2, 4)"); either gives the student its source's shape.
A seconds-long run with a fresh tiny teacher:
  distillax train --config distillax/configs/distill.py:tiny --workdir runs/kd_tiny
"""

from distillax.configs import sections
from distillax.configs.common import base_config, parse_arg, shrink_for_tiny


def get_config(arg: str | None = None):
  c = base_config("demo_student")
  c.trainer = "distill"
  c.teacher = sections.teacher_section()
  c.student = sections.student_section()
  c.distill = sections.distill_section()
  c.cache = sections.cache_section()  # read by `distillax cache-teacher`
  # Usual practice for LLM distillation: T=2, alpha=0.7, AdamW wd 0.1, clip 1.0, warmup+cosine.
  c.optimizer.weight_decay = 0.1
  c.optimizer.grad_clip_norm = 1.0
  c.optimizer.schedule = "warmup_cosine"
  if parse_arg(arg, tiny=False).tiny:
    shrink_for_tiny(c)
    c.teacher.preset = "tiny"
    c.model.num_layers = 1
  return c
