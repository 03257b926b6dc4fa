"""The main job: distil and quantize a model end to end on the embedded corpus, no download.

  distillax demo --config distillax/configs/demo.py --workdir runs/demo --devices 8   (`make demo`)
  distillax demo --config distillax/configs/demo.py:tiny --workdir runs/demo_tiny --devices 8

(`--devices 8` simulates the 8 CPU devices of the 4x2 mesh.)

Stages (each its own workdir under the demo workdir; rerunning resumes/reuses them): teacher
pretraining, student from scratch (the baseline), distilled student (LogitKD + feature pooling),
quantization-aware distillation to llama.cpp's q4_0 weights / q8_0 activations, PTQ for
comparison, on-policy distillation and on-policy QAD from the distilled student; then the students exported as GGUF (f32, f16, q8_0 / q4_0 PTQ, q4_0 QAT) and run in
llama.cpp on this CPU (validation loss, bytes, tokens/s, peak RSS); report.md, report.json,
loss_curves.png and edge_size_quality.png in the workdir.
"""

import ml_collections

from distillax.configs import sections
from distillax.configs.common import base_config, model_config, parse_arg
from distillax.configs.draft_eagle3 import draft_section
from distillax.configs.on_policy import on_policy_section

# llama.cpp's q4_0 weights with q8_0 activations (what its CPU kernels compute for q4_0 files),
# so QAT trains against the deployed rounding; the tied embedding (module path "") stays f32.
Q4_0_RULES = (("", None, None, None), (".*", "q4_0", "q8_0", None))
# Progressive QAT's middle stage: per-channel int8 weights (activations full precision), the
# embedding again f32.
INT8_RULES = (("", None, None, None), (".*", "int8", None, None))


def _edge_settings(c: ml_collections.ConfigDict) -> None:
  """The edge rows: every GGUF file run in llama.cpp, one child process each."""
  c.edge_decode_tokens = 64  # one-token decode steps timed after the prompt (a validation row)
  c.edge_speed_rounds = 5  # timed rounds (median), after one warm-up
  c.edge_greedy_tokens = 32  # greedy tokens compared, llama.cpp vs distillax, per prompt
  # llama.cpp threads. 1: at this model size a thread barrier costs more than a matmul, and on a
  # shared machine a descheduled worker stalls the others (2 threads here timed 10x apart).
  c.edge_threads = 1


def _on_policy_settings() -> ml_collections.ConfigDict:
  """The on-policy stages (the same qat_steps from student_kd): how the student samples and is
  graded (configs/on_policy.py's section, sized for the demo)."""
  c = on_policy_section()
  c.prompt_len = 16  # the first 16 tokens of a document
  c.max_new_tokens = 32  # the student's completion, up to EOS
  c.num_prompts = 1024  # train documents the steps take prompts from
  # Reverse KL (GKD's beta = 1): the divergence the report's reverse-KL figure measures, and
  # mode-seeking, so the student writes where the teacher puts its mass, which lowers the
  # teacher's NLL of its samples too (beta 0.5 lowered the reverse KL but not that NLL).
  c.beta = 1.0
  c.lmbda = 1.0  # every step on the student's own samples
  # Up to 64 held-out prompts x 32 tokens (the stdlib's validation split gives 41): the
  # standard errors over the 16 prompts used before were as large as the differences.
  c.eval_prompts = 64
  return c


def _distill_settings() -> ml_collections.ConfigDict:
  """The distilled student's loss (and the later stages' validation objective)."""
  c = sections.distill_section()
  c.logit.weight = 1.0
  # Temperature 1 and the whole logit loss on the teacher (no hard-label share): the student's
  # next-token CE is judged at temperature 1, and the teacher (its loss far below what the
  # student reaches in these steps) is a better target than the one-hot data token.
  c.logit.temperature = 1.0
  c.logit.alpha = 1.0
  # The teacher's pooled features weigh 2: the strongest of the tried weights (0, 0.5, 2) on
  # the student's next-token CE in these steps.
  c.feature_pooling.weight = 2.0
  return c


def _text_eval_settings() -> ml_collections.ConfigDict:
  """The report's task columns (demo/task_scores.py): greedy completions of held-out code scored
  with BLEU / chrF, and one local lm-eval task, for every row."""
  c = ml_collections.ConfigDict()
  c.prompts = 64  # held-out prompts (validation documents cut at a line break)
  c.prompt_chars = 192  # characters of document before the cut in each prompt (at most)
  c.new_tokens = 32  # greedy tokens per completion, and tokens of each reference
  c.task = "distillax_code_mc"  # lm-eval task(s), comma-separated (eval/tasks/ runs offline)
  c.task_limit = 0  # documents per task (0 = all)
  return c


def _draft_settings() -> ml_collections.ConfigDict:
  """The draft stage (demo/draft.py): an EAGLE-3 head for the teacher."""
  c = draft_section()
  # The byte tokenizer's 256 most frequent ids of its 259 (a multiple of the mesh's model axis)
  c.vocab_size = 256
  c.steps = 200  # steps of the head against the frozen teacher
  c.learning_rate = 3e-3  # the head's peak lr
  c.prompts = 32  # held-out prompts continued with each draft (head, distilled student)
  c.new_tokens = 48  # greedy tokens per prompt
  return c


def _shrink_to_tiny(c: ml_collections.ConfigDict) -> None:
  """`demo.py:tiny`: every stage, the report and the edge rows in seconds (the tests' demo)."""
  # One layer as the student's: every teacher forward (its stage, the distilled stages' steps
  # and evals, on-policy grading, the draft head's target, the report's rows) compiles a third
  # smaller program than with the preset's two layers.
  c.teacher_model = model_config("tiny", vocab_size=0, num_layers=1)
  c.student_model = model_config("tiny", vocab_size=0, num_layers=1)
  c.teacher_steps, c.student_steps, c.qat_steps = 6, 4, 3
  c.progressive_qat = ((1, INT8_RULES), (2, Q4_0_RULES))
  c.qat_seeds = 1
  c.train.batch_size, c.train.seq_len = 8, 32
  c.train.eval_every, c.train.eval_batches, c.train.log_every = 2, 2, 1
  c.report_eval_batches = 3
  c.train.progress = False
  c.optimizer.warmup_steps = 1
  c.data.shuffle_buffer = 64
  c.sample_tokens = 8
  c.edge_decode_tokens, c.edge_speed_rounds = 16, 1
  c.on_policy.prompt_len, c.on_policy.max_new_tokens, c.on_policy.eval_prompts = 8, 8, 4
  c.on_policy.num_prompts = 64  # 3 steps of 8 prompts
  # No sampling-only program timed beside each on-policy step: one compile and two decodes
  # fewer per on-policy stage (the report reads no sampling speed).
  c.on_policy.time_sampling = False
  c.text_eval.prompts, c.text_eval.prompt_chars, c.text_eval.new_tokens = 4, 24, 8
  c.text_eval.task_limit = 2
  c.draft.steps, c.draft.ttt_steps, c.draft.prompts, c.draft.new_tokens = 2, 2, 4, 8
  c.draft.vocab_batches = 2


def get_config(arg: str | None = None):
  b = base_config()
  c = ml_collections.ConfigDict()
  c.job = "demo"  # run by `distillax demo`, not `distillax train`
  c.seed = 0  # seeds every stage
  c.backend = "jit"  # backend of every stage
  c.mesh = b.mesh
  c.mesh.data, c.mesh.model = 4, 2  # 4x2 mesh of 8 simulated CPU devices
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
  # Validation batches of the stages' evals (and of `distillax eval --model <stage>`: each
  # stage's `eval` in report.json); 16 made the teacher's step-300 eval 10% worse than step
  # 250's, and the rollback guard stopped the demo. The report's table and llama.cpp's rows
  # read 16 (32,768 tokens): on the stages' 8,192 the q4_0 PTQ cost (~0.002 nats there) was
  # below QAT's own noise, and QAT lost to PTQ on them while it beat PTQ on these.
  c.train.eval_batches, c.report_eval_batches = 4, 16
  c.train.log_every = 10
  c.train.export_format = "gguf"  # the students go to llama.cpp: checked at each stage's start
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
  # Seeds of QAT and its fp twin (extra stages <stage>_seed<k>): recovery stated over them.
  c.qat_seeds = 3
  c.distill = _distill_settings()
  # QAT/PTQ/export: llama.cpp's q4_0 weights and q8_0 activations; the tied embedding (module
  # path "") stays full precision, as deployments usually keep it.
  c.quant_rules = Q4_0_RULES
  # Progressive QAT against it at the same step count: fp for the first 20 of the 60 steps,
  # int8 weights for the next 20, then the same q4_0 / q8_0 rules (a qat.schedule).
  c.progressive_qat = ((20, INT8_RULES), (40, Q4_0_RULES))
  c.on_policy = _on_policy_settings()
  c.text_eval = _text_eval_settings()
  c.draft = _draft_settings()
  _edge_settings(c)
  c.sample_prompts = ("def ", "import ", "class ")  # samples printed at the end
  c.sample_tokens = 48  # tokens generated per sample
  if parse_arg(arg, tiny=False).tiny:
    _shrink_to_tiny(c)
  return c
