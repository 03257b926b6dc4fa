"""Divergences between distributions given as log-probabilities over their last axis (fp32).

P is always the TEACHER and Q the STUDENT:
  forward_kl: KL(P || Q) = sum P (log P - log Q)       (mass-covering; the classic Hinton KD)
  reverse_kl: KL(Q || P) = sum Q (log Q - log P)       (mode-seeking)
  jsd:        beta * KL(P || M) + (1 - beta) * KL(Q || M),  M = beta * P + (1 - beta) * Q
              (generalised Jensen-Shannon, as in GKD; beta = 0.5 is the symmetric JSD)

Top-k teacher buckets: the student stays normalised over the full vocabulary; the two
distributions are compared over K + 1 buckets: the teacher's top-k tokens, plus one "rest" bucket
holding the teacher's remaining mass (1 - its top-k mass) against the student's mass on every
token outside the teacher's top-k. Nothing is renormalised, so a student that puts mass outside the
teacher's top-k is penalised exactly as much as the teacher's own rest mass says. With k >= V
there is no rest bucket and the result equals full-vocabulary KD.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
# The teacher's rest mass is floored at this (its log at log(REST_FLOOR)): a cached rest mass is
# 1 - sum(top-k probabilities), which rounds to 0 or below when the top-k hold (nearly) all the
# mass; the floor keeps reverse KL and JSD finite there and moves forward KL by < 1e-10.
REST_FLOOR = 1e-12


def kl(logp: jax.Array, logq: jax.Array) -> jax.Array:
  """KL(P || Q) over the last axis."""
  return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def divergence(kind: str, teacher_logp: jax.Array, student_logp: jax.Array,
               beta: float = 0.5) -> jax.Array:
  """D(teacher, student) per row for one of DIVERGENCES (teacher = P, student = Q)."""
  if kind == "forward_kl":
    return kl(teacher_logp, student_logp)
  if kind == "reverse_kl":
    return kl(student_logp, teacher_logp)
  if kind == "jsd":
    log_m = jnp.logaddexp(math.log(beta) + teacher_logp, math.log1p(-beta) + student_logp)
    return beta * kl(teacher_logp, log_m) + (1.0 - beta) * kl(student_logp, log_m)
  raise ValueError(f"unknown divergence {kind!r}; choose one of {', '.join(DIVERGENCES)}")


def student_buckets(student_logp_NxV: jax.Array, topk_ids_NxK: jax.Array) -> jax.Array:
  """Student log-probs over the teacher's top-k tokens plus one rest bucket: (N, K + 1).

  The rest is a logsumexp over every token outside the top-k (exact, no 1 - sum cancellation);
  with K == V there is no rest bucket: (N, V).
  """
  N, V = student_logp_NxV.shape
  top_NxK = jnp.take_along_axis(student_logp_NxV, topk_ids_NxK, axis=-1)
  if topk_ids_NxK.shape[-1] >= V:
    return top_NxK
  in_top_NxV = jnp.zeros((N, V), bool).at[jnp.arange(N)[:, None], topk_ids_NxK].set(True)
  rest_N = jax.nn.logsumexp(jnp.where(in_top_NxV, -jnp.inf, student_logp_NxV), axis=-1)
  return jnp.concatenate([top_NxK, rest_N[:, None]], axis=-1)


def teacher_buckets(topk_logp_NxK: jax.Array, vocab_size: int) -> jax.Array:
  """Teacher log-probs over its top-k tokens plus the floored rest mass: (N, K + 1), or (N, V)
  unchanged when K == V. The same function serves the online teacher and the offline cache."""
  if topk_logp_NxK.shape[-1] >= vocab_size:
    return topk_logp_NxK
  rest_N = 1.0 - jnp.sum(jnp.exp(topk_logp_NxK), axis=-1)
  log_rest_N = jnp.log(jnp.maximum(rest_N, REST_FLOOR))
  return jnp.concatenate([topk_logp_NxK, log_rest_N[:, None]], axis=-1)
