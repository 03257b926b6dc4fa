"""Knowledge distillation from several teachers at once (the `teachers` list).

Each teacher is a teacher section plus a name and a weight; `distill.teachers_mode` says how
they become one KD target: 'mixture' (sum_i w_i softmax(t_i / T), weights normalised) or
'routing' (each record learns from the teacher its batch's teacher index names). Launch with two
earlier runs of distillax/configs/lm.py as teachers:
  distillax train --config distillax/configs/distill_multi_teacher.py --workdir runs/kd2 \
      --config.teachers[0].workdir=runs/teacher_a --config.teachers[1].workdir=runs/teacher_b
A seconds-long run with two fresh tiny teachers (one preset, two seeds: two different teachers):
  distillax train --config distillax/configs/distill_multi_teacher.py:tiny --workdir runs/kd2_tiny
On-policy: the student's own samples graded by the teachers' mixture (or, with
--config.distill.teachers_mode=routing, each prompt's by its route's teacher); the `on_policy`
section of configs/on_policy.py:
  distillax train --config distillax/configs/distill_multi_teacher.py:tiny,on_policy \
      --workdir runs/op2_tiny
"""

from distillax.configs import on_policy, sections
from distillax.configs.common import base_config, parse_arg, shrink_for_tiny


def get_config(arg: str | None = None):
  c = base_config("demo_student")
  c.trainer = "distill_multi_teacher"
  c.teachers = [sections.teachers_entry("a"), sections.teachers_entry("b")]
  c.student = sections.student_section()
  c.distill = sections.multi_teacher_distill_section()
  c.optimizer.weight_decay = 0.1
  c.optimizer.grad_clip_norm = 1.0
  c.optimizer.schedule = "warmup_cosine"
  args = parse_arg(arg, tiny=False, on_policy=False)
  if args.tiny:
    shrink_for_tiny(c)
    for entry in c.teachers:
      entry.preset = "tiny"
    c.model.num_layers = 1
  if args.on_policy:
    c.trainer = "on_policy_multi_teacher"
    c.on_policy = on_policy.on_policy_section()
    if args.tiny:
      on_policy.shrink_on_policy_for_tiny(c)
  return c
