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

Two batches. Each optimizer step samples its whole sampling batch at once, with the step's
weights: train.batch_size prompts x on_policy.num_samples completions, S in all. It then learns
from them in micro-batches of on_policy.micro_batch completions (S / micro_batch of them, by
gradient accumulation: the same update as one micro-batch of S, still strictly on-policy).
How to choose them:
  - the sampling batch as large as the sampler's memory allows: a decode step reads the
    student's weights once for all its rows, so few rows leave the chip's bandwidth idle (6
    rows ran at 32% of a v5e's decode roofline). Sampling needs the student's matmul weights in
    bf16 and a bf16 KV cache of S x (prompt_len + max_new_tokens) positions, and runs before
    the update's activations exist, so it competes with the weights, optimizer state and
    teacher only, not with the update;
  - the micro-batch as large as the update fits (what one micro-batch's scoring forward,
    backward and teacher forward hold beside the weights, optimizer state and teacher);
  - `distillax plan` prints both: the sampler's memory at S and the compiled step's peak.
    benchmarks/accelerator.py's on_policy row measures candidate pairs on a chip.
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
  # Completions per update micro-batch; the step samples all train.batch_size x num_samples of
  # its completions at once (the sampling batch) and learns from them in micro-batches of this
  # many (gradient accumulation, train.accum_steps set from it). 0: train.accum_steps decides.
  # A multiple of num_samples that divides the sampling batch. See the module doc.
  c.micro_batch = 0
  # Prompt tokens per text document (BOS included); chat and prompt/completion records give
  # their whole prompt (chat template + generation prompt) and are skipped when longer.
  c.prompt_len = 32
  c.num_prompts = 4096  # train documents whose prompts the steps cycle through
  c.max_new_tokens = 64  # tokens sampled per completion (fewer when it stops at EOS/end of turn)
  c.sampling_temperature = 1.0  # the student's sampling temperature (0 = greedy)
  c.top_k = 0  # sample from the student's top-k tokens only (0 = off)
  c.top_p = 1.0  # nucleus sampling mass (1 = off)
  # The sampler's KV cache: '' (the compute dtype) or 'int8' (codes and a scale per token and
  # kv head: half the bytes each decode step reads, keys and values within half a code; needs
  # a scanned attention stack). The learner scores every sample with the exact model.
  c.kv_cache_dtype = ""
  c.eval_prompts = 16  # held-out prompts the student completes at every eval (fixed seed)
  c.eval_seed = 0  # sampling seed of the eval completions (the same at every eval)
  c.samples_to_write = 4  # eval completions written to <workdir>/on_policy_samples/ per eval
  c.time_sampling = True  # time a sampling-only program once per log interval (metrics)
  # Devices kept for the sampler (the last this many; one host): the trainer's mesh (`mesh`)
  # takes the others, and each step's weights go to the sampler device to device. 0: the
  # trainer's devices sample inside the step. See docs/guides/on-policy.md.
  c.sampler_devices = 0
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
