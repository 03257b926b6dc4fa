"""The cross-tokenizer distillation objective: student and teacher each run on their own tokens
of the same text inside the step, and the loss reads both models' logits at the aligned groups.

The batch comes from data.cross_tokenizer_rows: the student's packed-batch keys, the teacher's
inputs (its own length M) and the per-position alignment. The loss is LogitKD's mix over groups:

  loss = alpha * T^2 * (exact_weight * exact_kl + span_weight * span_kl + uld_weight * uld)
         + (1 - alpha) * CE(student, hard labels)

with the three terms of distill.cross_tokenizer summed over the groups of the batch and the CE
over the student's trained tokens; the step divides by the student's token count, so with one
tokenizer on both sides (every group one-to-one and exact) this is LogitKD's forward KL.

Memory: with a chunk_size (distill.chunk_size; the recipes pass theirs) the terms go through
the vocabulary-chunk engine (distill.cross_tokenizer_chunked): neither model's [tokens, V]
logits exist whole, at the price of making each model's logits twice, and once more at the
span groups' first positions. chunk_size=None holds both whole ([B, L, Vs] and [B, M, Vt] fp32)
and ULD's merged distributions ([B * (L + 1), max(Vs, Vt)]); the two agree
(tests/distill/cross_tokenizer/test_chunked.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from distillax.data import batch as batch_spec
from distillax.data.cross_tokenizer import rows
from distillax.distill.objective import TEACHER
from distillax.data.cross_tokenizer.alignment import EXACT, SPAN
from distillax.distill.cross_tokenizer.losses import AlignedTargets, cross_tokenizer_terms
from distillax.distill.cross_tokenizer.chunked import chunked_terms
from distillax.distill.student import unwrap_student
from distillax.errors import ConfigError
from distillax.framework import losses, token_rows, vocab_chunks
from distillax.framework.vocab_chunks import OutputLayer
from distillax.framework.step import ObjectiveOutput


def _teacher_inputs(batch) -> dict:
  return {"positions_BxL": batch[rows.TEACHER_POSITIONS],
          "segment_ids_BxL": batch[rows.TEACHER_SEGMENT_IDS]}


def _whole(model, teacher, batch, aligned, mask_BxL, ids, T, weights):
  """Both models' logits whole ([B, L, Vs] and [B, M, Vt] fp32; distill.cross_tokenizer)."""
  # The student's padded rows leave its softmax (framework/token_rows.py); the teacher's
  # tokenizer is another one, whose rows the step does not know: they stay.
  s_logits = token_rows.masked(
      model(batch[batch_spec.INPUTS], **losses.model_inputs(batch)).logits_BxLxV,
      token_rows.active())
  t_out = teacher(batch[rows.TEACHER_INPUTS], **_teacher_inputs(batch))
  t_logits = jax.lax.stop_gradient(t_out.logits_BxLxV)
  terms = cross_tokenizer_terms(s_logits, t_logits, aligned, *map(jnp.asarray, ids), T)
  hard_ce, _, _ = losses.cross_entropy_sums(s_logits, batch[batch_spec.TARGETS], mask_BxL)
  sums = {"exact_kl": terms.exact_kl, "span_kl": terms.span_kl, "uld": terms.uld,
          "hard_ce": hard_ce}
  return sum(weights[k] * sums[k] for k in weights), sums


def _chunked(model, teacher, batch, aligned, mask_BxL, ids, T, weights, chunk_size):
  """Through the vocabulary-chunk engine (distill.cross_tokenizer_chunked)."""
  s_hidden = model(batch[batch_spec.INPUTS], **losses.model_inputs(batch),
                   return_logits=False).final_hidden_BxLxD
  t_hidden = teacher(batch[rows.TEACHER_INPUTS], **_teacher_inputs(batch),
                     return_logits=False).final_hidden_BxLxD
  student = OutputLayer.of_model(model).over_token_rows(token_rows.active())
  return chunked_terms(student, s_hidden, OutputLayer.of_model(teacher),
                       t_hidden, aligned, mask_BxL, *map(jnp.asarray, ids), temperature=T,
                       weights=weights, chunk_size=chunk_size)


def make_cross_tokenizer_objective(student_ids_S: np.ndarray, teacher_ids_S: np.ndarray, *,
                                   temperature: float = 2.0, alpha: float = 0.7,
                                   exact_weight: float = 1.0, span_weight: float = 1.0,
                                   uld_weight: float = 1.0, teacher_key: str = TEACHER,
                                   chunk_size: int | None = None):
  """The step objective (student, extras, batch, rng) -> ObjectiveOutput; student_ids_S /
  teacher_ids_S: the shared vocabulary's id pairs (data.token_bytes.shared_vocab)."""
  if not temperature > 0 or not 0.0 <= alpha <= 1.0:
    raise ConfigError(f"distill.cross_tokenizer.temperature={temperature} must be > 0 and "
                      f"alpha={alpha} in [0, 1]")
  vocab_chunks.check_chunk_size(chunk_size)
  ids = (np.asarray(student_ids_S, np.int32), np.asarray(teacher_ids_S, np.int32))
  T = float(temperature)
  soft = float(alpha) * T ** 2
  weights = {"exact_kl": soft * exact_weight, "span_kl": soft * span_weight,
             "uld": soft * uld_weight, "hard_ce": 1.0 - float(alpha)}

  def objective(student, extras, batch, rng) -> ObjectiveOutput:
    del rng
    if teacher_key not in extras:
      raise ConfigError(f"the cross-tokenizer objective needs a teacher named {teacher_key!r} "
                        f"among the frozen extras ({sorted(extras)})")
    model, _ = unwrap_student(student)
    aligned = AlignedTargets(batch[batch_spec.TARGETS], batch[rows.TEACHER_TARGETS],
                             batch[rows.STUDENT_GROUP], batch[rows.TEACHER_GROUP],
                             batch[rows.GROUP_KIND])
    mask_BxL = batch[batch_spec.LOSS_MASK].astype(jnp.float32)
    if chunk_size is not None:
      loss_sum, sums = _chunked(model, extras[teacher_key], batch, aligned, mask_BxL, ids, T,
                                weights, chunk_size)
    else:
      loss_sum, sums = _whole(model, extras[teacher_key], batch, aligned, mask_BxL, ids, T,
                              weights)
    kinds = batch[rows.GROUP_KIND]
    exact_groups = jnp.sum(kinds == EXACT).astype(jnp.float32)
    span_groups = jnp.sum(kinds == SPAN).astype(jnp.float32)
    ratios = {"exact_group_share": (exact_groups, exact_groups + span_groups)}
    tokens = jnp.sum(mask_BxL)
    return ObjectiveOutput(loss_sum=loss_sum, tokens=tokens, sums=sums, ratios=ratios)

  return objective
