"""An EAGLE-3 speculative-decoding draft head trained against a frozen target.

The target is the teacher section's model (a distillax run, a Hugging Face checkpoint or a
preset), frozen in the step; the head reads its hidden states at three layers and learns its
next-token distribution over `draft.ttt_steps` steps of training-time test. The guide:
docs/guides/drafts.md.

Target from an earlier run of distillax/configs/lm.py with the demo_teacher model:
  distillax train --config distillax/configs/draft_eagle3.py --workdir runs/draft \
      --config.teacher.workdir=runs/teacher
On the target's own answers: it first continues 1024 train prompts (the sequence_kd section's
settings), written to runs/draft_regen/teacher_samples.jsonl and reused on resume:
  distillax train --config distillax/configs/draft_eagle3.py --workdir runs/draft_regen \
      --config.teacher.workdir=runs/teacher --config.draft.regenerate=True \
      --config.sequence_kd.num_prompts=1024
A seconds-long run against a fresh tiny target:
  distillax train --config distillax/configs/draft_eagle3.py:tiny --workdir runs/draft_tiny
  distillax eval --draft runs/draft_tiny
  distillax export --workdir runs/draft_tiny --output out/draft_tiny --format speculators
Qwen3-1.7B's shape (the accelerator benchmark's draft row):
  distillax plan --config distillax/configs/draft_eagle3.py:qwen3
"""

import ml_collections

from distillax.configs import sections
from distillax.configs.common import base_config, model_config, parse_arg, shrink_for_tiny


def draft_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Target hidden-state indices the head fuses (id i: the stream entering block i, as vLLM and
  # speculators count); () = EAGLE-3's low, middle, high: (2, L // 2, L - 3).
  c.aux_layers = ()
  c.ttt_steps = 3  # training-time-test steps: the tokens the head learns to propose in a row
  c.ttt_decay = 0.8  # weight of step j's loss: ttt_decay ** j
  c.vocab_size = 0  # draft vocabulary: the most frequent target ids in the data (0 = all)
  c.vocab_batches = 64  # train batches counted to pick the draft vocabulary
  c.train_lm_head = False  # False: the LM head stays the target's columns, frozen (EAGLE-3)
  # True: before training the target answers the train prompts (the sequence_kd section: how
  # many, how long, how sampled) and the head trains on its answers; False: the data as it is.
  c.regenerate = False
  return c


def get_config(arg: str | None = None):
  args = parse_arg(arg, tiny=False, qwen3=False)
  c = base_config("demo_teacher")  # model: the target's shape (the head is built from it)
  c.trainer = "draft"
  c.teacher = sections.teacher_section()
  c.student = sections.student_section()
  c.draft = draft_section()
  c.sequence_kd = sections.sequence_kd_section()  # read with draft.regenerate=True only
  c.optimizer.learning_rate = 1e-3  # one layer from scratch: EAGLE-3's heads train at 1e-4..1e-3
  c.optimizer.weight_decay = 0.0
  c.optimizer.grad_clip_norm = 0.5
  c.optimizer.schedule = "warmup_cosine"
  if args.qwen3:
    c.model = model_config("qwen3-1.7b", param_dtype="bfloat16", dtype="bfloat16")
    c.teacher.preset = "qwen3-1.7b"
    c.teacher.param_dtype = "bfloat16"
    c.teacher.dtype = "bfloat16"
    c.draft.vocab_size = 32000
    c.train.batch_size = 8
    c.train.seq_len = 2048
  if args.tiny:
    shrink_for_tiny(c)
    c.teacher.preset = "tiny"
    c.draft.vocab_size = 96
    c.draft.vocab_batches = 4
    c.optimizer.learning_rate = 3e-3
  return c
