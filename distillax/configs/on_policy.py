"""On-policy distillation: the student samples completions inside the step, the teacher scores
every token of them, and the student learns from its own samples (GKD; the tinker recipe).

Teacher from an earlier run of distillax/configs/lm.py with the demo_teacher model, student from
an earlier distillation run:
  distillax train --config distillax/configs/on_policy.py --workdir runs/op \
      --config.teacher.workdir=runs/teacher --config.train.init_from=runs/kd
Reverse KL through the sampled tokens (tinker's estimator) instead of the generalized JSD, and
half the steps teacher-forced on the data's own completions (the `distill` section's loss):
  distillax train --config distillax/configs/on_policy.py --workdir runs/op_mix \
      --config.teacher.workdir=runs/teacher --config.on_policy.divergence=sampled_kl \
      --config.on_policy.lmbda=0.5
On-policy QAD: a q4_0-weight / q8_0-activation student that samples in its fake-quantized form:
  distillax train --config distillax/configs/on_policy.py:tiny,q4_0 --workdir runs/opq_tiny
A seconds-long run with a fresh tiny teacher:
  distillax train --config distillax/configs/on_policy.py:tiny --workdir runs/op_tiny
"""

import ml_collections

from distillax.configs import distill
from distillax.configs.common import parse_arg

# llama.cpp's q4_0 weights with q8_0 activations; the top module (tied embedding) kept fp.
Q4_0_RULES = (("", None, None, None), (".*", "q4_0", "q8_0", None))


def on_policy_section() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.divergence = "gjsd"  # gjsd (full-vocabulary generalized JSD) | sampled_kl (tinker's estimator)
  c.beta = 0.5  # gjsd: 0 forward KL, 1 reverse KL, between the JSD of GKD
  c.temperature = 1.0  # temperature of both models' distributions inside the divergence
  c.lmbda = 1.0  # share of steps on student samples; the rest trains `distill` on the data
  c.num_samples = 1  # completions the student samples per prompt each step
  # Prompt tokens per text document (BOS included); chat and prompt/completion records give
  # their whole prompt (chat template + generation prompt) and are skipped when longer.
  c.prompt_len = 32
  c.num_prompts = 4096  # train documents whose prompts the steps cycle through
  c.max_new_tokens = 64  # tokens sampled per completion (fewer when it stops at EOS/end of turn)
  c.sampling_temperature = 1.0  # the student's sampling temperature (0 = greedy)
  c.top_k = 0  # sample from the student's top-k tokens only (0 = off)
  c.top_p = 1.0  # nucleus sampling mass (1 = off)
  c.eval_prompts = 16  # held-out prompts the student completes at every eval (fixed seed)
  c.eval_seed = 0  # sampling seed of the eval completions (the same at every eval)
  c.samples_to_write = 4  # eval completions written to <workdir>/on_policy_samples/ per eval
  c.time_sampling = True  # time a sampling-only program once per log interval (metrics)
  return c


def shrink_on_policy_for_tiny(c) -> None:
  """The seconds-long shape of an on-policy job (`:tiny`)."""
  c.train.batch_size = 8
  c.on_policy.prompt_len = 8
  c.on_policy.max_new_tokens = 16
  c.on_policy.num_samples = 2
  c.on_policy.num_prompts = 64
  c.on_policy.eval_prompts = 8


def get_config(arg: str | None = None):
  # The distillation config (teacher, student, the `distill` loss of the lmbda < 1 share and of
  # the validation loss, optimizer defaults, tiny shrink) with the on-policy section.
  args = parse_arg(arg, tiny=False, q4_0=False)
  c = distill.get_config("tiny" if args.tiny else None)
  c.trainer = "on_policy"
  del c["cache"]
  c.on_policy = on_policy_section()
  if args.tiny:
    shrink_on_policy_for_tiny(c)
  if args.q4_0:
    c.qat.rules = Q4_0_RULES  # every matmul's inputs must be a multiple of 32 (q4_0 blocks)
  return c
