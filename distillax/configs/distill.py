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
Llama 3.1 8B (bf16, frozen) into Llama 3.2 1B at pod scale (`at_pod_scale`), sized for a TPU slice
by its own compiler:
  distillax plan --config distillax/configs/distill.py:llama --target tpu:v5e-8 \
      --config.train.batch_size=16
Any preset pair the same way: the teacher's preset and the student's (its shape and, unless the
config's table is the teacher preset's, its vocabulary; how it runs stays the config's), e.g.
  distillax plan --config distillax/configs/distill.py:llama --target gpu:h100x8 \
      --config.teacher.preset=qwen3-1.7b --config.model.preset=qwen3-0.6b
"""

from distillax.configs import sections
from distillax.configs.common import base_config, model_config, parse_arg, shrink_for_tiny


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
  args = parse_arg(arg, tiny=False, llama=False)
  if args.llama:
    return at_pod_scale(c, "llama3.2-1b", "llama3.1-8b")
  if args.tiny:
    shrink_for_tiny(c)
    c.teacher.preset = "tiny"
    c.model.num_layers = 1
  return c


def at_pod_scale(c, student: str, teacher: str, **student_fields):
  """The real-size job of a family config (distill_moe, distill_gemma3, distill_qwen35): a
  `teacher` preset frozen in bf16 inside the step into a `student` preset with fp32 master
  weights, bf16 compute and full remat, at batch 64 x 2048 for 1,000 steps."""
  c.model = model_config(student, param_dtype="float32", dtype="bfloat16", remat="full",
                         **student_fields)
  c.teacher.preset = teacher
  c.teacher.param_dtype = "bfloat16"
  c.teacher.dtype = "bfloat16"
  c.optimizer.learning_rate = 1e-4
  c.optimizer.warmup_steps = 100
  c.train.batch_size = 64
  c.train.seq_len = 2048
  c.train.steps = 1000
  c.train.eval_every = 200
  c.checkpoint.every_steps = 200
  return c
