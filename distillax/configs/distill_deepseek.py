"""Distil a DeepSeek V3-shape teacher (671B: latent attention, 8 of 256 experts per token in 58
of 61 layers, DeepSeek-R1 and V3.1 alike) into a dense Llama 3.1 8B-shape student that speaks the
teacher's 129,280-token vocabulary, so logit KD compares the two distributions id for id. The
teacher runs frozen in bf16 inside the step with its experts over `data` (fsdp_ep: 4 of 256 per
device on 64 chips, tokens exchanged by all_to_all) and the rest split like fsdp; the student is
fsdp with fp32 master weights, bf16 compute and full remat.

Size the job with the TPU compiler (the aot extra), never materialising a parameter:
  distillax plan --config distillax/configs/distill_deepseek.py --target tpu:v5p-128
(the figures: docs/guides/moe.md). Train (on real hardware) with the released teacher as
Hugging Face ships it (its multi-token-prediction layer is skipped with one line) and chats on
local disk:
  distillax train --config distillax/configs/distill_deepseek.py --workdir runs/ds_kd \
      --config.teacher.hf_path=models/DeepSeek-R1 --config.data.source=data/chats.jsonl \
      --config.data.tokenizer=hf:models/DeepSeek-R1
A seconds-long run on 8 devices: a fresh tiny DeepSeek V3 teacher (a dense layer, then 8 experts
over a data axis of 4, latent attention) into a tiny dense Qwen3-shape student, tensor parallel
over a model axis of 2 (ep_tp):
  distillax train --config distillax/configs/distill_deepseek.py:tiny --workdir runs/ds_tiny \
      --devices 8
"""

from distillax.configs import distill
from distillax.configs.common import model_config, parse_arg

DEEPSEEK_VOCAB = 129_280  # DeepSeek V3's table: the student's too


def get_config(arg: str | None = None):
  # distill.py's LogitKD (T=2, alpha=0.7), AdamW + clipping + warmup/cosine and its `:tiny`.
  tiny = parse_arg(arg, tiny=False).tiny
  c = distill.get_config("tiny" if tiny else None)
  c.partitioning.strategy = "fsdp_ep"  # experts over data (whole), everything else fsdp
  if tiny:
    # tiny_deepseek_v3's 8 experts over a data axis of 4; the rest tp over model (its 4 heads,
    # the student's heads, kv heads, MLP widths and vocabulary all divide by 2).
    c.teacher.preset = "tiny_deepseek_v3"
    c.model = model_config("tiny", vocab_size=0, qk_norm=True, num_layers=1)
    c.partitioning.strategy = "ep_tp"
    c.mesh.data, c.mesh.model = 4, 2
    return c
  c = distill.at_pod_scale(c, "llama3.1-8b", "deepseek-v3", vocab_size=DEEPSEEK_VOCAB)
  return c
