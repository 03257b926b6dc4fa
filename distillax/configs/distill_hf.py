"""Distil your own Hugging Face model: a pretrained teacher, a student derived from it (or a
pretrained one of its family) and a chat data set on local disk -> distil -> export -> chat.

Put the teacher's checkpoint directory at models/teacher (config.json, *.safetensors and
tokenizer.json with its chat template, as save_pretrained writes them; Llama, Gemma, Gemma 2,
Qwen2/2.5, Qwen3 or Mistral) and the chats at data/chats.jsonl, one line per conversation:
{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}
(prompt/completion or text records, and Parquet files, work too). Every path is relative to the
directory the commands run in. Chats are rendered with the teacher's chat template and only the
assistant turns are trained (CE and KD); 5% of the chats are held out for the eval.

Distil a student made of teacher blocks 0, 2 and 4 (embeddings, final norm and head come too):
  distillax train --config distillax/configs/distill_hf.py --workdir runs/hf_kd \
      --config.teacher.hf_path=models/teacher --config.student.from_teacher.layers="(0, 2, 4)" \
      --config.data.source=data/chats.jsonl --config.data.tokenizer=hf:models/teacher
Or start from a smaller pretrained checkpoint of the teacher's family (the same tokenizer):
  distillax train --config distillax/configs/distill_hf.py --workdir runs/hf_kd_small \
      --config.teacher.hf_path=models/teacher --config.student.hf_path=models/student \
      --config.data.source=data/chats.jsonl --config.data.tokenizer=hf:models/teacher
The student's validation loss and perplexity on the held-out chats (the trainer's numbers):
  distillax eval --model runs/hf_kd
Export it as a Hugging Face checkpoint with the tokenizer, chat template and generation config
(the run's config.json says what it is):
  distillax export --workdir runs/hf_kd --output out/student_hf
Chat with it (transformers' AutoTokenizer and AutoModelForCausalLM load out/student_hf too):
  distillax generate --model out/student_hf \
      --messages '[{"role": "user", "content": "What does os.path.join do?"}]'
`:tiny` makes any of the train commands above a seconds-long run; without the flags, it distils
a fresh tiny teacher on the embedded corpus:
  distillax train --config distillax/configs/distill_hf.py:tiny --workdir runs/hf_kd_tiny
"""

from distillax.configs import distill
from distillax.configs.common import parse_arg


def get_config(arg: str | None = None):
  # The distillation config (LogitKD T=2, alpha=0.7; AdamW, clipping, warmup + cosine; its
  # `:tiny` shrink) with the settings of fine-tuning pretrained weights on chats.
  c = distill.get_config(arg)
  if parse_arg(arg, tiny=False).tiny:
    return c
  c.optimizer.learning_rate = 1e-4  # pretrained weights: a third of distill.py's from scratch
  c.optimizer.warmup_steps = 50
  c.train.steps = 1000
  c.train.seq_len = 1024  # chats packed into rows; loss masks and segment ids keep them apart
  c.train.eval_every = 200
  c.train.eval_batches = 16
  c.checkpoint.every_steps = 200
  return c
