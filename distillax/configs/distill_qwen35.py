"""Distil a Qwen3.5 9B-shape teacher into a Qwen3.5 0.8B-shape student: both hybrid, three Gated
DeltaNet layers to each gated full-attention layer, the teacher frozen in bf16 inside the step,
the student fsdp with fp32 master weights. Both shapes share Qwen3.5's 248,320-row table, so
logit KD needs no vocabulary change.

Size the job on a laptop, never materialising a parameter:
  distillax plan --config distillax/configs/distill_qwen35.py --devices 64 --memory_gb 95
Train (on real hardware) with the released teacher as Hugging Face ships it and chats on disk:
  distillax train --config distillax/configs/distill_qwen35.py --workdir runs/qwen35_kd \
      --config.teacher.hf_path=models/Qwen3.5-9B --config.data.source=data/chats.jsonl \
      --config.data.tokenizer=hf:models/Qwen3.5-9B
A seconds-long run on 8 devices: a fresh tiny Qwen3.5 teacher (4 layers) into a 2-layer tiny
Qwen3.5 student (one Gated DeltaNet layer, one gated attention layer):
  distillax train --config distillax/configs/distill_qwen35.py:tiny --workdir runs/qwen35_tiny
"""

from distillax.configs import distill
from distillax.configs.common import model_config, parse_arg


def get_config(arg: str | None = None):
  # distill.py's LogitKD (T=2, alpha=0.7), AdamW + clipping + warmup/cosine and its `:tiny`.
  tiny = parse_arg(arg, tiny=False).tiny
  c = distill.get_config("tiny" if tiny else None)
  if tiny:
    c.model = model_config("tiny_qwen35", vocab_size=0, num_layers=2,
                           token_mixers=("linear_attention", "full_attention"))
    c.teacher.preset = "tiny_qwen35"
    return c
  return distill.at_pod_scale(c, "qwen3.5-0.8b", "qwen3.5-9b")
