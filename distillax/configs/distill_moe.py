"""Distil a mixture-of-experts teacher into a dense student: a Qwen3-30B-A3B-shape teacher (128
experts, top-8) into a Qwen3-1.7B-shape student, with the teacher's experts over `data` (fsdp_ep).

The teacher runs inside the step (bf16, frozen) and is never written to a checkpoint; on resume it
is reloaded from its source. Size the job on a laptop, never materialising a parameter:
  distillax plan --config distillax/configs/distill_moe.py --devices 64 --memory_gb 95
The Qwen3-235B-A22B teacher shape on 256 devices: its 128 experts do not divide a data axis of
256, so one expert per data row of a 128 x 2 mesh, the rest tensor parallel (ep_tp):
  distillax plan --config distillax/configs/distill_moe.py --devices 256 --memory_gb 95 \
      --config.teacher.preset=qwen3-235b-a22b --config.train.batch_size=256 \
      --config.partitioning.strategy=ep_tp --config.mesh.model=2
Either with the TPU compiler instead (plan --target, the aot extra): --target tpu:v5p-128 for
the first, --target tpu:v5p-512 for the second.
Train (on real hardware) with the released teacher as Hugging Face ships it (config.json,
safetensors, tokenizer.json; nothing to convert) and chats on local disk:
  distillax train --config distillax/configs/distill_moe.py --workdir runs/moe_kd \
      --config.teacher.hf_path=models/Qwen3-30B-A3B --config.data.source=data/chats.jsonl \
      --config.data.tokenizer=hf:models/Qwen3-30B-A3B
A seconds-long run on 8 devices: a fresh tiny MoE teacher (4 experts, top-2, over a data axis
of 4) into a tiny dense student (ep_tp: tensor parallel over a model axis of 2):
  distillax train --config distillax/configs/distill_moe.py:tiny --workdir runs/moe_kd_tiny \
      --devices 8
Gemma 4 (`:gemma4`): the 26B-A4B-shape teacher (8 of 128 experts beside a dense MLP per layer)
into the dense E2B-shape student (one 262,144-token vocabulary), and its tiny run (tiny_gemma4_moe
into tiny_gemma4):
  distillax plan --config distillax/configs/distill_moe.py:gemma4 --devices 64 --memory_gb 95
  distillax train --config distillax/configs/distill_moe.py:tiny,gemma4 --workdir runs/g4_kd_tiny \
      --devices 8
Qwen3.5 (`:qwen35`): the 35B-A3B-shape teacher (8 of 256 experts beside a gated shared expert
per layer, Gated DeltaNet and gated attention layers) into the dense 0.8B-shape student (one
248,320-token vocabulary), and its tiny run (tiny_qwen35_moe into a 2-layer tiny_qwen35):
  distillax plan --config distillax/configs/distill_moe.py:qwen35 --devices 64 --memory_gb 95
  distillax train --config distillax/configs/distill_moe.py:tiny,qwen35 --workdir runs/q35_kd_tiny \
      --devices 8
"""

from distillax.configs import distill
from distillax.configs.common import model_config, parse_arg


def get_config(arg: str | None = None):
  # distill.py's LogitKD (T=2, alpha=0.7), AdamW + clipping + warmup/cosine and its `:tiny`.
  args = parse_arg(arg, tiny=False, gemma4=False, qwen35=False)
  tiny = args.tiny
  c = distill.get_config("tiny" if tiny else None)
  c.partitioning.strategy = "fsdp_ep"  # experts over data (whole), everything else fsdp
  if tiny:
    # tiny_moe's 4 experts over a data axis of 4; the rest tp over model (heads, kv heads, mlp
    # widths and vocab all divide by 2): both axes of an EP mesh at test size.
    c.teacher.preset = "tiny_moe"
    c.partitioning.strategy = "ep_tp"
    c.mesh.data, c.mesh.model = 4, 2
    if args.gemma4:
      c.teacher.preset = "tiny_gemma4_moe"
      c.model = model_config("tiny_gemma4", vocab_size=0)
      c.partitioning.replicate_indivisible = True  # the full layers' one key/value head
    if args.qwen35:
      c.teacher.preset = "tiny_qwen35_moe"
      c.model = model_config("tiny_qwen35", vocab_size=0, num_layers=2,
                             token_mixers=("linear_attention", "full_attention"))
    return c
  if args.gemma4:
    return distill.at_pod_scale(c, "gemma4-e2b", "gemma4-26b-a4b")
  if args.qwen35:
    return distill.at_pod_scale(c, "qwen3.5-0.8b", "qwen3.5-35b-a3b")
  return distill.at_pod_scale(c, "qwen3-1.7b", "qwen3-30b-a3b")
