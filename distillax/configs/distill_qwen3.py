"""Distil a Qwen3-1.7B-shape teacher into a Qwen3-0.6B-shape student on one chip (a TPU v5e's
15.75 GiB): the teacher frozen in bf16 inside the step, the student with fp32 master weights and
bf16 compute, full remat, sequence 2048, both on Qwen3's 151,936-row table (tied embeddings,
q/k norms, scanned layers). The pair users distil on a single accelerator, and the one the
first-step time is measured on (issue 45: from `distillax train` starting to step 1).

Data: the default offline corpus (the standard library's .py files, the byte tokenizer, which
needs no preparation), so it runs with nothing downloaded; the model keeps Qwen3's vocabulary
size, so every matmul and the vocabulary loss have the real pair's shapes. Batch 4 x 2048: the
largest that fits the chip with remat=full in the lever sweep (8 x 2048 compiled to 18.3 GB).

Size it for the chip with its own compiler (the aot extra), on a laptop:
  distillax plan --config distillax/configs/distill_qwen3.py --target tpu:v5e-1
Train on the chip, or with the released teacher and real chats:
  distillax train --config distillax/configs/distill_qwen3.py --workdir runs/qwen3_kd
  distillax train --config distillax/configs/distill_qwen3.py --workdir runs/qwen3_kd \
      --config.teacher.hf_path=models/Qwen3-1.7B --config.data.source=data/chats.jsonl \
      --config.data.tokenizer=hf:models/Qwen3-1.7B
A seconds-long run on 8 devices: the 2-layer tiny teacher in bf16 into a 1-layer student with the
Qwen3 structure (q/k norms, tied embeddings, scanned layers; fp32 master, bf16 compute):
  distillax train --config distillax/configs/distill_qwen3.py:tiny --workdir runs/qwen3_kd_tiny
"""

from distillax.configs import distill
from distillax.configs.common import model_config, parse_arg

_QWEN3 = dict(qk_norm=True, tie_embeddings=True, scan_layers=True)  # what the tiny pair keeps


def get_config(arg: str | None = None):
  # distill.py's LogitKD (T=2, alpha=0.7), AdamW + clipping + warmup/cosine and its `:tiny`.
  tiny = parse_arg(arg, tiny=False).tiny
  c = distill.get_config("tiny" if tiny else None)
  if tiny:
    c.model = model_config("tiny", vocab_size=0, num_layers=1, param_dtype="float32",
                           dtype="bfloat16", **_QWEN3)
    c.teacher.preset = "tiny"
    c.teacher.param_dtype = c.teacher.dtype = "bfloat16"
    return c
  c = distill.at_pod_scale(c, "qwen3-0.6b", "qwen3-1.7b")
  c.train.batch_size = 4
  return c
