"""On-policy scoring over vocabulary slices (framework/vocab_slices.py): either loss, from one
teacher or several (mixed or routed: distill/sliced_teacher.py), and the figures score_rollout
reports beside it, with no (tokens, V) array.

Each needs per token only normalisers and sums over the vocabulary. GeneralizedJSD is the
slices' divergence with no hard-label term and no T^2 (beta 0: forward KL, 1: reverse KL,
between: the jsd and its second pass); SampledTokenKL a function of the two models' target
log-probabilities at T and the sampler's (slice_targets.py). The reverse KL and the teacher's NLL
at T = 1 are slice_metrics' carries, the student's NLL the slices' own.
"""

from __future__ import annotations

import jax

from distillax.data import batch as batch_spec
from distillax.distill.base import DistillInputs
from distillax.distill.multi_teacher import TeacherMix
from distillax.distill.sliced_teacher import sliced_teacher
from distillax.distill.on_policy.losses import (SAMPLE_LOGPROBS, GeneralizedJSD, SampledTokenKL,
                                                sampled_token_surrogate)
from distillax.errors import ConfigError
from distillax.framework import losses, token_loss_impl, vocab_slices


def sliced_scoring(leaf) -> bool:
  """Whether the slices score this leaf: GeneralizedJSD or SampledTokenKL."""
  return isinstance(leaf, (GeneralizedJSD, SampledTokenKL))


def divergence_of(beta: float) -> str:
  """GeneralizedJSD's beta as the slices name its divergence (the end points are the KLs)."""
  return {0.0: "forward_kl", 1.0: "reverse_kl"}.get(float(beta), "jsd")


def _term(leaf) -> dict:
  """The Spec fields of the leaf's per-token term."""
  if isinstance(leaf, SampledTokenKL):
    return {"target_term": sampled_token_surrogate}
  divergence = divergence_of(leaf.beta)
  return {"divergence": divergence, "beta": float(leaf.beta) if divergence == "jsd" else 0.5}


def sliced_score_sums(leaf, inputs: DistillInputs, teachers: TeacherMix | None = None
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(weight * the leaf's sum, sums of the leaf and of reverse_kl, teacher_nll, student_nll)
  over the masked tokens: the chunk engine's names (score_rollout's token values). `teachers`:
  the teacher is their TeacherSet, folded per token."""
  flat = losses.flat_tokens
  student, h_s = losses.sliced_head(inputs.student_model, inputs.student.final_hidden_BxLxD)
  teacher, h_t = sliced_teacher(inputs.teacher_model, inputs.teacher.final_hidden_BxLxD,
                                teachers, inputs.batch)
  spec = vocab_slices.Spec(kd_weight=float(leaf.weight), ce_weight=0.0,
                           temperature=float(leaf.temperature), accuracy=True, metrics=True,
                           **_term(leaf))
  mask_BxL = inputs.batch[batch_spec.LOSS_MASK]
  sampler = None
  if isinstance(leaf, SampledTokenKL):
    if SAMPLE_LOGPROBS not in inputs.batch:
      raise ConfigError(f"SampledTokenKL {leaf.name!r}: the batch has no {SAMPLE_LOGPROBS}; it "
                        f"scores samples the on-policy objective draws (objective.py)")
    sampler = inputs.batch[SAMPLE_LOGPROBS]
  loss, sums = vocab_slices.token_sums(spec, student, h_s, flat(inputs.batch[batch_spec.TARGETS]),
                                       flat(mask_BxL), teacher, h_t,
                                       target_input_N=None if sampler is None else flat(sampler))
  token_loss_impl.record(vocab_slices.describe(spec, student, mask_BxL.size))
  return loss, {leaf.name: sums["divergence"], "reverse_kl": sums["reverse_kl"],
                "teacher_nll": sums["teacher_nll"], "student_nll": sums["nll"]}
