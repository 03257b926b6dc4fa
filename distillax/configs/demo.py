"""The main job: distil and quantize a model end to end on the embedded corpus, no download.

  distillax demo --config distillax/configs/demo.py --workdir runs/demo --devices 8   (`make demo`)
  distillax demo --config distillax/configs/demo.py:tiny --workdir runs/demo_tiny --devices 8

(`--devices 8` simulates the 8 CPU devices of the 4x2 mesh.)

Stages (each its own workdir under the demo workdir; rerunning resumes/reuses them): teacher
pretraining, student from scratch (the baseline), distilled student (LogitKD + feature pooling),
quantization-aware distillation to int4 weights / int8 activations, PTQ for comparison, int4
export; then report.md, report.json and loss_curves.png in the workdir.
"""

import ml_collections

from distillax.configs import sections
from distillax.configs.common import base_config, model_config, parse_arg
from distillax.quant import INT4_INT8_RULES


def get_config(arg: str | None = None):
  b = base_config()
  c = ml_collections.ConfigDict()
  c.job = "demo"  # run by `distillax demo`, not `distillax train`
  c.seed = 0  # seeds every stage
  c.backend = "jit"  # backend of every stage
  c.mesh = b.mesh
  c.mesh.data = 4  # 4x2 mesh of 8 simulated CPU devices
  c.mesh.model = 2
  c.partitioning = b.partitioning
  c.partitioning.strategy = "fsdp_tp"
  c.data = b.data
  c.optimizer = b.optimizer
  c.optimizer.learning_rate = 3e-3  # peak lr of the student stages
  c.optimizer.warmup_steps = 20
  c.checkpoint = b.checkpoint
  c.checkpoint.every_steps = 100
  c.train = b.train
  c.train.batch_size = 16
  c.train.seq_len = 128
  c.train.eval_every = 50
  c.train.eval_batches = 4
  c.train.log_every = 10
  # Teacher: wider and deeper than the student, trained longer on the same data.
  # Sized so the whole demo fits ~10 minutes on 2 CPU cores: a ~1.6M-parameter teacher and a
  # ~0.45M student (teacher width a multiple of the student's, for feature pooling).
  c.teacher_model = model_config("demo_teacher", vocab_size=0, embed_dim=192, num_layers=4,
                                 num_heads=6, num_kv_heads=2, head_dim=32, mlp_dim=512)
  c.teacher_steps = 600  # teacher pretraining steps
  c.teacher_learning_rate = 2e-3  # teacher peak lr
  c.student_model = model_config("demo_student", vocab_size=0, embed_dim=96, num_layers=4,
                                 num_heads=4, num_kv_heads=2, head_dim=24, mlp_dim=256)
  c.student_steps = 200  # steps of the scratch and the distilled student (same token budget)
  c.qat_steps = 60  # quantization-aware distillation steps, starting from the distilled student
  c.qat_learning_rate = 5e-4  # QAT peak lr
  c.distill = sections.distill_section()
  c.distill.logit.weight = 1.0
  c.distill.feature_pooling.weight = 0.5
  # QAT/PTQ/export: int4 weights, int8 activations; the tied embedding (module path "")
  # stays full precision, as deployments usually keep it.
  c.quant_rules = INT4_INT8_RULES
  c.report_eval_batches = 16  # validation batches behind every number of the report
  c.sample_prompts = ("def ", "import ", "class ")  # samples printed at the end
  c.sample_tokens = 48  # tokens generated per sample
  if parse_arg(arg, tiny=False).tiny:
    c.teacher_model = model_config("tiny", vocab_size=0)
    c.student_model = model_config("tiny", vocab_size=0, num_layers=1)
    c.teacher_steps, c.student_steps, c.qat_steps = 6, 4, 3
    c.train.batch_size, c.train.seq_len = 8, 32
    c.train.eval_every, c.train.eval_batches, c.train.log_every = 2, 2, 1
    c.train.progress = False
    c.optimizer.warmup_steps = 1
    c.data.shuffle_buffer = 64
    c.report_eval_batches = 2
    c.sample_tokens = 8
  return c
