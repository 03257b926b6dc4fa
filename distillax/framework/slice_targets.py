"""A per-token term of the target's log-probability at a temperature under each model, over
vocabulary slices (vocab_slices.py, `Spec.target_term`): on-policy SampledTokenKL's
importance-weighted policy gradient (distill/on_policy/losses.py), whose value per token is
f(log q_T(y), log p_T(y), x), x a per-token input (the sampler's log-probability of y).

What it reads per token the first pass already carries: both models' log-sum-exps at T (the
divergences' 'normalisers', slice_divergences.py) and each model's logit at the target y. Its
gradient by one slice of the student's logits follows from lq_y = s_y / T - logsumexp(s / T):

  d f / d s_v = f'(lq_y) ([v = y] - q_v) / T,    q = softmax(s / T)

with f' autodiff's over (N,) arrays (a stop_gradient inside f holds: SampledTokenKL's advantage
is a constant), so the term's gradient needs no second pass and no teacher logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def value_and_coefficient(term, s_y_N, t_y_N, lse, x_N, T: float):
  """(f per token, f' by the student's target log-probability per token)."""
  lp_N = t_y_N / T - lse["t"]
  value_N, back = jax.vjp(lambda lq_N: term(lq_N, lp_N, x_N), s_y_N / T - lse["sT"])
  return value_N, back(jnp.ones_like(value_N))[0]


def logit_grad(coefficient_N, s_NxS, targets_N, start, lse, T: float):
  """d f / d s over one slice's columns, per token (s the slice's fp32 student logits)."""
  cols = start + jnp.arange(s_NxS.shape[-1])
  q = jnp.exp(s_NxS / T - lse["sT"][:, None])
  return coefficient_N[:, None] * ((cols == targets_N[:, None]).astype(jnp.float32) - q) / T
