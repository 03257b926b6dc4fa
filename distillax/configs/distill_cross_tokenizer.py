"""Cross-tokenizer distillation: a teacher whose tokenizer differs from the student's.

Each text is cut by both tokenizers in the data pipeline and the two cuts are aligned by their
bytes: tokens that match one to one are compared by KL over the shared vocabulary, spans cut
differently by the probability of the span (GOLD) and ULD. One document window per row (rows
are not packed); text records only for now. Teacher from an earlier lm.py run with its own
tokenizer, the student on another:
  distillax train --config distillax/configs/distill_cross_tokenizer.py --workdir runs/xkd \
      --config.teacher.workdir=runs/teacher --config.teacher.tokenizer=hf:tok_teacher \
      --config.data.tokenizer=hf:tok_student
teacher.tokenizer may be left out where the teacher brings its tokenizer.json (a Hugging Face
checkpoint in teacher.hf_path, or a run trained on an hf: tokenizer): empty means its own.
The weights of the three terms, the temperature and alpha are distill.cross_tokenizer.*.
A seconds-long run: a fresh tiny teacher on a 1024-id BPE, the student on a 512-id BPE, both
trained on the embedded corpus (data/corpus_bpe.py; cached after the first run):
  distillax train --config distillax/configs/distill_cross_tokenizer.py:tiny --workdir runs/xkd_tiny
On-policy: the student samples completions of the data's prompts, the host cuts their text with
the teacher's tokenizer and aligns the two cuts, and the same three terms train the student on
its own samples (the `on_policy` section: prompts and sampling; lmbda must be 1; its
divergence, beta and temperature are not read: the loss is distill.cross_tokenizer.*):
  distillax train --config distillax/configs/distill_cross_tokenizer.py:tiny,on_policy \
      --workdir runs/xop_tiny
"""

from distillax.configs import distill
from distillax.configs.common import parse_arg
from distillax.configs.on_policy import on_policy_section
from distillax.data.corpus_bpe import corpus_bpe


def get_config(arg: str | None = None):
  args = parse_arg(arg, tiny=False, on_policy=False)
  c = distill.get_config("tiny" if args.tiny else None)
  del c["cache"]  # no teacher cache: the teacher runs on its own tokens in the step
  c.distill.objective = "cross_tokenizer"
  c.data.tokenizer = f"hf:{corpus_bpe(512)}"
  # teacher.tokenizer stays empty: a teacher checkpoint's (or run's) own tokenizer, as the guide
  # says; only :tiny's fresh preset teacher, which brings none, is given one of its own.
  if args.tiny:
    c.teacher.tokenizer = f"hf:{corpus_bpe(1024)}"
    c.model.vocab_size = 0  # the student's tokenizer's (512)
  if args.on_policy:
    c.trainer = "on_policy"
    c.on_policy = on_policy_section()
    if args.tiny:
      c.train.batch_size = 8
      c.on_policy.prompt_len, c.on_policy.max_new_tokens = 8, 16
      c.on_policy.num_samples, c.on_policy.num_prompts = 2, 64
  return c
