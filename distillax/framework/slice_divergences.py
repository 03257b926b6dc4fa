"""The distillation divergences over vocabulary slices (vocab_slices.py): what each carries from
slice to slice per token, its value from those carries, and its gradient with respect to one
slice of the student's logits.

P is the teacher, Q the student, both at temperature T: lp = t / T - lse_t, lq = s / T - lse_sT
with lse_t = logsumexp(t / T), lse_sT = logsumexp(s / T) (distill/divergences.py has the same
definitions over whole log-probabilities):

  forward_kl  KL(P || Q) = sum_v p_v (t_v - s_v) / T - lse_t + lse_sT: the teacher-weighted sum
              of (t - s) / T, carried online beside the teacher's running maximum as flash
              attention carries its output; d / ds_v = (q_v - p_v) / T.
  reverse_kl  KL(Q || P) = sum_v q_v (s_v - t_v) / T - lse_sT + lse_t: the same sum weighted by
              the student; d / ds_v = q_v (lq_v - lp_v - KL(Q || P)) / T.
  jsd         beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q: log M_v needs
              both normalisers, so a second pass over the slices sums it once the first pass has
              them; d / ds_v = (g_v - q_v sum_u g_u) / T with g_v = (1 - beta) q_v (lq_v - log M_v)
              (the derivative by lq_v; sum_u g_u = (1 - beta) KL(Q || M), kept per token).
              lq_v - log M_v is -log1p(beta expm1(lp_v - lq_v)), lp_v - lq_v from t_v - s_v:
              the difference of two log-probabilities near -log V lost ~1e-3 of the gradient's
              scale in float32 (tests/framework/test_slice_divergences.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def check(divergence: str, beta: float) -> None:
  if divergence not in DIVERGENCES:
    raise ValueError(f"divergence {divergence!r}; choose one of {', '.join(DIVERGENCES)}")
  if divergence == "jsd" and not 0.0 < beta < 1.0:
    raise ValueError(f"jsd beta={beta!r} must be strictly between 0 and 1")


def init(divergence: str, N: int) -> dict[str, jax.Array]:
  """The per-token carries of the first pass: both models' running maximum and sum of
  exponentials at T, and for the KLs the weighted sum of the logit difference (a jsd and the
  top-k buckets, `divergence` 'normalisers', carry the normalisers only)."""
  neg, zero = jnp.full((N,), -jnp.inf, jnp.float32), jnp.zeros((N,), jnp.float32)
  carry = {"mq": neg, "lq": zero, "mt": neg, "lt": zero}
  if divergence in ("forward_kl", "reverse_kl"):
    carry["a"] = zero
  return carry


def online_step(m, l, z_NxS):
  """One slice more of an online log-sum-exp: (running max, sum of exp(z - max), the old sum's
  rescale exp(m - max), this slice's exp(z - max)), the last two for sums carried beside it."""
  m_new = jnp.maximum(m, jnp.max(z_NxS, axis=-1))
  keep, w = jnp.exp(m - m_new), jnp.exp(z_NxS - m_new[:, None])
  return m_new, l * keep + jnp.sum(w, axis=-1), keep, w


def lse_step(m, l, z_NxS):
  """One slice more of an online log-sum-exp (max m, sum of exp(z - m) l)."""
  return online_step(m, l, z_NxS)[:2]


def weighted_step(m, l, a, z_NxS, x_NxS):
  """lse_step, and a = sum of exp(z - m) x carried with it."""
  m_new, l_new, keep, w = online_step(m, l, z_NxS)
  return m_new, l_new, a * keep + jnp.sum(w * x_NxS, axis=-1)


def step(divergence: str, carry, s_NxS, t_NxS, new_NxS, T: float) -> dict[str, jax.Array]:
  """The carries after one more slice; s and t are -inf in the columns that do not count."""
  c = dict(carry)
  if divergence == "forward_kl":
    diff = jnp.where(new_NxS, (t_NxS - s_NxS) / T, 0.0)
    c["mt"], c["lt"], c["a"] = weighted_step(carry["mt"], carry["lt"], carry["a"], t_NxS / T,
                                             diff)
  else:
    c["mt"], c["lt"] = lse_step(carry["mt"], carry["lt"], t_NxS / T)
  if divergence == "reverse_kl":
    diff = jnp.where(new_NxS, (s_NxS - t_NxS) / T, 0.0)
    c["mq"], c["lq"], c["a"] = weighted_step(carry["mq"], carry["lq"], carry["a"], s_NxS / T,
                                             diff)
  else:
    c["mq"], c["lq"] = lse_step(carry["mq"], carry["lq"], s_NxS / T)
  return c


def normalisers(carry) -> dict[str, jax.Array]:
  """{'sT': logsumexp(s / T), 't': logsumexp(t / T)} per token."""
  return {"sT": carry["mq"] + jnp.log(carry["lq"]), "t": carry["mt"] + jnp.log(carry["lt"])}


def kl_value(divergence: str, carry, lse) -> jax.Array:
  """A KL per token from the first pass's carries (jsd: from jsd_terms' second pass)."""
  if divergence == "forward_kl":
    return carry["a"] / carry["lt"] - lse["t"] + lse["sT"]
  return carry["a"] / carry["lq"] - lse["sT"] + lse["t"]


def _log_probs(s_NxS, t_NxS, lse, T):
  return s_NxS / T - lse["sT"][:, None], t_NxS / T - lse["t"][:, None]


# Past this lp - lq, log(1 + beta expm1(d)) is d + log(beta) to float32's precision (the rest is
# (1 - beta) e^-d / beta: under 1e-7 for beta >= 1e-6), and expm1 would overflow at 88.
_JSD_LINEAR_FROM = 30.0


def _student_log_ratio(s_NxS, t_NxS, lse, T: float, beta: float):
  """(lp - lq, lq - log M) per column, from the logits' difference rather than as the small
  difference of two log-probabilities near -log V: on a TPU the jsd's gradient over slices was
  3e-4 of its scale off the CPU's where the whole logits' was 5e-5 (chip call 39)."""
  d = (t_NxS - s_NxS) / T - (lse["t"] - lse["sT"])[:, None]
  small = jnp.log1p(beta * jnp.expm1(jnp.minimum(d, _JSD_LINEAR_FROM)))
  return d, -jnp.where(d > _JSD_LINEAR_FROM, d + math.log(beta), small)


def jsd_terms(s_NxS, t_NxS, new_NxS, lse, T: float, beta: float):
  """One slice's share of (the jsd, (1 - beta) KL(Q || M)) per token."""
  lq, lp = _log_probs(s_NxS, t_NxS, lse, T)
  d, q_log_ratio = _student_log_ratio(s_NxS, t_NxS, lse, T, beta)
  student = (1.0 - beta) * jnp.exp(lq) * q_log_ratio
  both = beta * jnp.exp(lp) * (d + q_log_ratio) + student
  return (jnp.sum(jnp.where(new_NxS, both, 0.0), axis=-1),
          jnp.sum(jnp.where(new_NxS, student, 0.0), axis=-1))


def logit_grad(divergence: str, beta: float, s_NxS, t_NxS, lse, T: float) -> jax.Array:
  """d divergence / d s over one slice's columns, per token (lse holds the per-token 'kl' of a
  reverse KL, 'jq' = (1 - beta) KL(Q || M) of a jsd)."""
  lq, lp = _log_probs(s_NxS, t_NxS, lse, T)
  q = jnp.exp(lq)
  if divergence == "forward_kl":
    return (q - jnp.exp(lp)) / T
  if divergence == "reverse_kl":
    return q * (lq - lp - lse["kl"][:, None]) / T
  _, q_log_ratio = _student_log_ratio(s_NxS, t_NxS, lse, T, beta)
  return ((1.0 - beta) * q * q_log_ratio - q * lse["jq"][:, None]) / T
