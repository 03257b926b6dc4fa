"""Distil a Gemma 3 27B-shape teacher into a Gemma 3 1B-shape student: both slide five layers
in six with their own RoPE per layer kind (models/config.py: rope_local_theta), the teacher
frozen in bf16 inside the step, the student fsdp with fp32 master weights.

The student keeps the 1B's own 262,144-row table; the 27B's pads 64 rows past it (262,208),
ids no tokenizer emits, which distillation cuts from the teacher's logits chunk by chunk.
Size the job on a laptop:
  distillax plan --config distillax/configs/distill_gemma3.py --devices 64 --memory_gb 95
Train (on real hardware) with the released teacher as Hugging Face ships it (a multimodal
Gemma3ForConditionalGeneration checkpoint: its text decoder is read) and chats on local disk:
  distillax train --config distillax/configs/distill_gemma3.py --workdir runs/gemma3_kd \
      --config.teacher.hf_path=models/gemma-3-27b-it --config.data.source=data/chats.jsonl \
      --config.data.tokenizer=hf:models/gemma-3-27b-it
A seconds-long run on 8 devices: a fresh tiny Gemma 3 teacher into a 2-layer tiny Gemma 3:
  distillax train --config distillax/configs/distill_gemma3.py:tiny --workdir runs/gemma3_tiny
"""

from distillax.configs import distill
from distillax.configs.common import model_config, parse_arg


def get_config(arg: str | None = None):
  # distill.py's LogitKD (T=2, alpha=0.7), AdamW + clipping + warmup/cosine and its `:tiny`.
  tiny = parse_arg(arg, tiny=False).tiny
  c = distill.get_config("tiny" if tiny else None)
  if tiny:
    c.model = model_config("tiny_gemma3", vocab_size=0, num_layers=2)
    c.teacher.preset = "tiny_gemma3"
    return c
  return distill.at_pod_scale(c, "gemma3-1b", "gemma3-27b")
