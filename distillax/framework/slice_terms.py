"""Several distillation terms over vocabulary slices in one pass (vocab_slices.py, `Spec.terms`):
a weighted sum of LogitKDs, each with its own temperature, divergence (slice_divergences.py) and
weight, read from the same slices of both models' logits, so that a Composite of logit terms
needs neither the chunk engine nor a pass over the vocabulary per term.

What the first pass carries per token: for each distinct temperature T, both models' running
maximum and sum of exponentials of logits / T (shared by every term at that T: a slice's
exponentials are made once per model and temperature), and for each KL term the weighted sum of
the logits' difference that slice_divergences carries (by the teacher's weights for a forward
KL, by the student's for a reverse KL). A jsd's per-column terms need both normalisers first: a
second pass sums every jsd term at once. The loss is the terms' weighted sum, its gradient by a
slice of the student's logits the terms' weighted sum of slice_divergences.logit_grad.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from distillax.framework import slice_divergences


@dataclasses.dataclass(frozen=True)
class Term:
  """One term: kd_weight * divergence(softmax(t / T), softmax(s / T)) per token (beta: a jsd's
  teacher weight)."""

  kd_weight: float
  temperature: float = 1.0
  divergence: str = "forward_kl"
  beta: float = 0.5


def check(terms) -> None:
  for term in terms:
    slice_divergences.check(term.divergence, term.beta)


def temperatures(terms) -> tuple[float, ...]:
  """The distinct temperatures, in the terms' order: one pair of normalisers each."""
  return tuple(dict.fromkeys(float(term.temperature) for term in terms))


def init(terms, N: int) -> dict:
  neg, zero = jnp.full((N,), -jnp.inf, jnp.float32), jnp.zeros((N,), jnp.float32)
  return {"norm": tuple({"mq": neg, "lq": zero, "mt": neg, "lt": zero}
                        for _ in temperatures(terms)),
          "a": tuple(None if term.divergence == "jsd" else zero for term in terms)}


def step(terms, carry, s_NxS, t_NxS, new_NxS) -> dict:
  """The carries after one more slice; s and t are -inf in the columns that do not count."""
  norm, weights = [], {}
  for T, c in zip(temperatures(terms), carry["norm"]):
    mq, lq, keep_s, w_s = slice_divergences.online_step(c["mq"], c["lq"], s_NxS / T)
    mt, lt, keep_t, w_t = slice_divergences.online_step(c["mt"], c["lt"], t_NxS / T)
    norm.append({"mq": mq, "lq": lq, "mt": mt, "lt": lt})
    weights[T] = {"forward_kl": (keep_t, w_t), "reverse_kl": (keep_s, w_s)}
  a = []
  for term, a_i in zip(terms, carry["a"]):
    if a_i is None:  # a jsd: its second pass
      a.append(None)
      continue
    T = float(term.temperature)
    keep, w = weights[T][term.divergence]
    diff = (t_NxS - s_NxS) if term.divergence == "forward_kl" else (s_NxS - t_NxS)
    a.append(a_i * keep + jnp.sum(w * jnp.where(new_NxS, diff / T, 0.0), axis=-1))
  return {"norm": tuple(norm), "a": tuple(a)}


def values(terms, carry, over_slices) -> tuple[dict, ...]:
  """Per term what its value and gradient read per token: both normalisers at its temperature
  ('sT', 't'), its divergence ('kl') and a jsd's (1 - beta) KL(Q || M) ('jq'). over_slices(step,
  init): a scan over every slice whose step takes (carry, s, t, new); run once for all the jsd
  terms, none without one."""
  lse = {T: slice_divergences.normalisers(c) for T, c in zip(temperatures(terms), carry["norm"])}
  out = []
  for term, a_i in zip(terms, carry["a"]):
    T = float(term.temperature)
    d = dict(lse[T])
    if a_i is not None:
      c = carry["norm"][temperatures(terms).index(T)]
      d["kl"] = slice_divergences.kl_value(term.divergence, {**c, "a": a_i}, d)
    out.append(d)
  jsd = [i for i, term in enumerate(terms) if term.divergence == "jsd"]
  if jsd:
    def jsd_step(acc, s_NxS, t_NxS, new_NxS):
      return tuple(tuple(x + y for x, y in zip(acc_i, slice_divergences.jsd_terms(
          s_NxS, t_NxS, new_NxS, out[i], float(terms[i].temperature), float(terms[i].beta))))
                   for acc_i, i in zip(acc, jsd))
    zero = jnp.zeros_like(lse[temperatures(terms)[0]]["sT"])
    for i, (kl, jq) in zip(jsd, over_slices(jsd_step, tuple((zero, zero) for _ in jsd))):
      out[i].update(kl=kl, jq=jq)
  return tuple(out)


def loss_and_sums(terms, per_term, mask_N):
  """(the terms' weighted value per token, each term's divergence summed over the mask)."""
  loss_N = sum(float(term.kd_weight) * d["kl"] for term, d in zip(terms, per_term))
  return loss_N, tuple(jnp.sum(d["kl"] * mask_N) for d in per_term)


def logit_grad(terms, per_term, s_NxS, t_NxS) -> jax.Array:
  """d (the terms' weighted sum) / d s over one slice's columns, per token."""
  return sum(float(term.kd_weight) * slice_divergences.logit_grad(
      term.divergence, float(term.beta), s_NxS, t_NxS, d, float(term.temperature))
             for term, d in zip(terms, per_term))
