"""Distillation losses between a student and a teacher with different tokenizers.

The two sequences are one text cut two ways; data.token_alignment groups their tokens into runs
that cover the same bytes, and says per predicting position which group its next token belongs
to. Three terms compare the two models over those groups:

  exact_kl  one-to-one groups whose two tokens are the same byte string: KL(teacher || student)
            of the next-token distributions over the shared vocabulary (ids with the same byte
            string on both sides, data.token_bytes.shared_vocab) plus one rest bucket each for
            the mass outside it, floored like divergences' top-k rest. With one tokenizer on
            both sides every id is shared and this is the ordinary token-level forward KL. When
            every student id is shared (a teacher vocabulary that extends the student's), the
            student's floored rest makes the teacher's rest term a constant and the shared part
            pulls the student towards the teacher's shared mass, renormalised.
  span_kl   groups whose spans differ (the GOLD idea, TRL's GOLDTrainer): each model's
            probability of the group's text is the product of its conditionals over its own
            tokens of the group, P = prod p(x_i | x_<i); the two span probabilities are
            compared as Bernoulli distributions, P_t log(P_t / P_s) + (1 - P_t) log((1 - P_t) /
            (1 - P_s)): zero exactly when the student gives the text the teacher's probability.
  uld       the same groups, by Universal Logit Distillation (Boizard et al., 2024): the distance
            between the two models' sorted probability vectors, the shorter vocabulary padded
            with zeros, sum_k |sort(p_s)_k - sort(p_t)_k|. Which token holds which probability
            does not matter, so no vocabulary map is needed. Each side's vector is GOLD's merged
            distribution: the group's first position's distribution scaled by the conditional
            probabilities of the group's remaining tokens (one-token groups: unchanged).

Every term is a sum over one batch's groups (the step divides once by the global count); the
counts of groups come with them. Logits are whole here ([B, L, V]); the vocabulary-chunk engine
is for the job wiring.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from distillax.data.cross_tokenizer.alignment import EXACT, SPAN
from distillax.distill.cross_tokenizer import span_groups
from distillax.distill.cross_tokenizer.uld import uld_distance
from distillax.distill.divergences import REST_FLOOR

# Span probabilities are kept below 1 - ~1e-12, so both Bernoulli outcomes stay finite.
_SPAN_LOGP_CEILING = -1e-12


class CrossTokenizerTerms(NamedTuple):
  exact_kl: jax.Array      # sum over EXACT groups
  span_kl: jax.Array       # sum over SPAN groups
  uld: jax.Array           # sum over SPAN groups
  exact_groups: jax.Array  # how many EXACT groups were scored
  span_groups: jax.Array   # how many SPAN groups were scored


def _log1mexp(x: jax.Array) -> jax.Array:
  """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2 (and NaN-free gradients)."""
  near_zero = x > -math.log(2.0)
  hi = jnp.log(-jnp.expm1(jnp.where(near_zero, x, -1.0)))
  lo = jnp.log1p(-jnp.exp(jnp.where(near_zero, -1.0, x)))
  return jnp.where(near_zero, hi, lo)


def bernoulli_kl(teacher_logp: jax.Array, student_logp: jax.Array) -> jax.Array:
  """KL(Bernoulli(P_t) || Bernoulli(P_s)) from log P_t, log P_s (clipped below log 1)."""
  lp = jnp.minimum(teacher_logp, _SPAN_LOGP_CEILING)
  lq = jnp.minimum(student_logp, _SPAN_LOGP_CEILING)
  return jnp.exp(lp) * (lp - lq) - jnp.expm1(lp) * (_log1mexp(lp) - _log1mexp(lq))


def shared_kl(teacher_logp_NxVt: jax.Array, student_logp_NxVs: jax.Array,
              teacher_ids_S: jax.Array, student_ids_S: jax.Array) -> jax.Array:
  """KL(teacher || student) over the shared ids plus a rest bucket per side (floored)."""
  shared_t_NxS = teacher_logp_NxVt[:, teacher_ids_S]
  shared_s_NxS = student_logp_NxVs[:, student_ids_S]

  def rest(logp_NxV, ids_S):
    outside_V = jnp.ones(logp_NxV.shape[-1], bool).at[ids_S].set(False)
    rest_N = jax.nn.logsumexp(jnp.where(outside_V, logp_NxV, -jnp.inf), axis=-1)
    return jnp.maximum(rest_N, math.log(REST_FLOOR))

  rest_t_N = rest(teacher_logp_NxVt, teacher_ids_S)
  rest_s_N = rest(student_logp_NxVs, student_ids_S)
  shared_N = jnp.sum(jnp.exp(shared_t_NxS) * (shared_t_NxS - shared_s_NxS), axis=-1)
  return shared_N + jnp.exp(rest_t_N) * (rest_t_N - rest_s_N)


def _per_group(logp_BxLxV, targets_BxL, group_BxL, num_groups):
  """(span log-prob [B*G], the first position's log-probs [B*G, V], the first position's target
  log-prob [B*G]) of each group, from one side's log-probs."""
  B, L, V = logp_BxLxV.shape
  target_logp_BxL = jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
  segment_BxL = jnp.where(group_BxL >= 0, jnp.arange(B)[:, None] * num_groups + group_BxL,
                          B * num_groups)
  segments = B * num_groups + 1  # the last one collects positions in no group
  span_logp = jax.ops.segment_sum(target_logp_BxL.reshape(-1), segment_BxL.reshape(-1), segments)
  first = jax.ops.segment_min(jnp.arange(B * L), segment_BxL.reshape(-1), segments)
  first = jnp.clip(first[:-1], 0, B * L - 1)  # empty groups read row 0; their kind masks them
  return (span_logp[:-1], logp_BxLxV.reshape(B * L, V)[first],
          target_logp_BxL.reshape(-1)[first])


class AlignedTargets(NamedTuple):
  """One batch's alignment, per predicting position i (data.token_alignment.alignment_targets,
  padded with -1 / SKIP)."""
  student_targets_BxL: jax.Array  # the token student position i predicts
  teacher_targets_BxM: jax.Array  # the token teacher position i predicts
  student_group_BxL: jax.Array    # that token's group, -1 when none is scored
  teacher_group_BxM: jax.Array
  group_kind_BxG: jax.Array       # how each group is compared: EXACT, SPAN or SKIP


def per_group_terms(student_logits_BxLxVs: jax.Array, teacher_logits_BxMxVt: jax.Array,
                    aligned: AlignedTargets, student_ids_S: jax.Array, teacher_ids_S: jax.Array,
                    temperature: float = 1.0) -> dict[str, jax.Array]:
  """Each group's terms, [B, G] each (0 where a term does not apply); student_ids_S /
  teacher_ids_S: the shared vocabulary's id pairs."""
  (student_targets_BxL, teacher_targets_BxM, student_group_BxL, teacher_group_BxM,
   group_kind_BxG) = aligned
  B, G = group_kind_BxG.shape
  student_logp = jax.nn.log_softmax(student_logits_BxLxVs.astype(jnp.float32) / temperature, -1)
  teacher_logp = jax.nn.log_softmax(teacher_logits_BxMxVt.astype(jnp.float32) / temperature, -1)
  span_s, first_s_GxVs, first_target_s = _per_group(student_logp, student_targets_BxL,
                                                    student_group_BxL, G)
  span_t, first_t_GxVt, first_target_t = _per_group(teacher_logp, teacher_targets_BxM,
                                                    teacher_group_BxM, G)
  kind = group_kind_BxG.reshape(-1)
  exact, span = kind == EXACT, kind == SPAN
  exact_kl = shared_kl(first_t_GxVt, first_s_GxVs, teacher_ids_S, student_ids_S)
  # Rows of other groups stay at their first distribution: finite values, finite gradients.
  merged_s = jnp.exp(first_s_GxVs + jnp.where(span, span_s - first_target_s, 0.0)[:, None])
  merged_t = jnp.exp(first_t_GxVt + jnp.where(span, span_t - first_target_t, 0.0)[:, None])
  terms = {"exact_kl": jnp.where(exact, exact_kl, 0.0),
           "span_kl": jnp.where(span, bernoulli_kl(span_t, span_s), 0.0)}
  terms = {name: value.reshape(B, G) for name, value in terms.items()}
  rows = lambda merged_NxV, index_BxR: jnp.take_along_axis(
      merged_NxV.reshape(B, G, -1), index_BxR[..., None], 1)
  uld = lambda index_BxR: {"uld": uld_distance(rows(merged_s, index_BxR),
                                               rows(merged_t, index_BxR))}
  return {**terms, **span_groups.over_selected(uld, span.reshape(B, G))}


def cross_tokenizer_terms(student_logits_BxLxVs: jax.Array, teacher_logits_BxMxVt: jax.Array,
                          aligned: AlignedTargets, student_ids_S: jax.Array,
                          teacher_ids_S: jax.Array,
                          temperature: float = 1.0) -> CrossTokenizerTerms:
  """The three terms summed over one batch, with the counts of groups scored by each."""
  per_group = per_group_terms(student_logits_BxLxVs, teacher_logits_BxMxVt, aligned,
                              student_ids_S, teacher_ids_S, temperature)
  return CrossTokenizerTerms(
      **{name: jnp.sum(value) for name, value in per_group.items()},
      exact_groups=jnp.sum(aligned.group_kind_BxG == EXACT).astype(jnp.float32),
      span_groups=jnp.sum(aligned.group_kind_BxG == SPAN).astype(jnp.float32))


def cross_tokenizer_loss(terms: CrossTokenizerTerms, *, exact_weight: float = 1.0,
                         span_weight: float = 1.0, uld_weight: float = 1.0) -> jax.Array:
  """The weighted sum of the terms (a sum over groups, like every objective's loss)."""
  return exact_weight * terms.exact_kl + span_weight * terms.span_kl + uld_weight * terms.uld
