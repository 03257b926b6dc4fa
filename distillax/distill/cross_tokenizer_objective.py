"""The cross-tokenizer distillation objective: student and teacher each run on their own tokens
of the same text inside the step, and the loss reads both models' logits at the aligned groups.

The batch comes from data.cross_tokenizer_rows: the student's packed-batch keys, the teacher's
inputs (its own length M) and the per-position alignment. The loss is LogitKD's mix over groups:

  loss = alpha * T^2 * (exact_weight * exact_kl + span_weight * span_kl + uld_weight * uld)
         + (1 - alpha) * CE(student, hard labels)

with the three terms of distill.cross_tokenizer summed over the groups of the batch and the CE
over the student's trained tokens; the step divides by the student's token count, so with one
tokenizer on both sides (every group one-to-one and exact) this is LogitKD's forward KL.

Memory: both models' logits are whole ([B, L, Vs] and [B, M, Vt] fp32; the vocabulary-chunk
engine is not used here), and ULD sorts one merged distribution per group over the larger
vocabulary ([B * (L + 1), max(Vs, Vt)]): about two more logit arrays. Fine at the sizes this
runs today; long rows of a 262k vocabulary need ULD over a top-k, not built yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from distillax.data import batch as batch_spec
from distillax.data import cross_tokenizer_rows as rows
from distillax.distill.objective import TEACHER
from distillax.distill.cross_tokenizer import (AlignedTargets, cross_tokenizer_loss,
                                               cross_tokenizer_terms)
from distillax.distill.student import unwrap_student
from distillax.errors import ConfigError
from distillax.framework import losses
from distillax.framework.step import ObjectiveOutput


def _teacher_inputs(batch) -> dict:
  return {"positions_BxL": batch[rows.TEACHER_POSITIONS],
          "segment_ids_BxL": batch[rows.TEACHER_SEGMENT_IDS]}


def make_cross_tokenizer_objective(student_ids_S: np.ndarray, teacher_ids_S: np.ndarray, *,
                                   temperature: float = 2.0, alpha: float = 0.7,
                                   exact_weight: float = 1.0, span_weight: float = 1.0,
                                   uld_weight: float = 1.0, teacher_key: str = TEACHER):
  """The step objective (student, extras, batch, rng) -> ObjectiveOutput; student_ids_S /
  teacher_ids_S: the shared vocabulary's id pairs (data.token_bytes.shared_vocab)."""
  if not temperature > 0 or not 0.0 <= alpha <= 1.0:
    raise ConfigError(f"distill.cross_tokenizer.temperature={temperature} must be > 0 and "
                      f"alpha={alpha} in [0, 1]")
  student_ids_S = np.asarray(student_ids_S, np.int32)
  teacher_ids_S = np.asarray(teacher_ids_S, np.int32)
  T = float(temperature)

  def objective(student, extras, batch, rng) -> ObjectiveOutput:
    del rng
    if teacher_key not in extras:
      raise ConfigError(f"the cross-tokenizer objective needs a teacher named {teacher_key!r} "
                        f"among the frozen extras ({sorted(extras)})")
    model, _ = unwrap_student(student)
    s_logits = model(batch[batch_spec.INPUTS], **losses.model_inputs(batch)).logits_BxLxV
    t_out = extras[teacher_key](batch[rows.TEACHER_INPUTS], **_teacher_inputs(batch))
    t_logits = jax.lax.stop_gradient(t_out.logits_BxLxV)
    aligned = AlignedTargets(batch[batch_spec.TARGETS], batch[rows.TEACHER_TARGETS],
                             batch[rows.STUDENT_GROUP], batch[rows.TEACHER_GROUP],
                             batch[rows.GROUP_KIND])
    terms = cross_tokenizer_terms(s_logits, t_logits, aligned, jnp.asarray(student_ids_S),
                                  jnp.asarray(teacher_ids_S), T)
    soft = cross_tokenizer_loss(terms, exact_weight=exact_weight, span_weight=span_weight,
                                uld_weight=uld_weight)
    mask_BxL = batch[batch_spec.LOSS_MASK].astype(jnp.float32)
    hard_ce, _, tokens = losses.cross_entropy_sums(s_logits, batch[batch_spec.TARGETS], mask_BxL)
    loss_sum = alpha * T ** 2 * soft + (1.0 - alpha) * hard_ce
    sums = {"exact_kl": terms.exact_kl, "span_kl": terms.span_kl, "uld": terms.uld,
            "hard_ce": hard_ce}
    ratios = {"exact_group_share": (terms.exact_groups, terms.exact_groups + terms.span_groups)}
    return ObjectiveOutput(loss_sum=loss_sum, tokens=tokens, sums=sums, ratios=ratios)

  return objective
