"""The metrics of both models' logits over vocabulary slices (vocab_slices.py, `Spec.metrics`):
what an eval objective and on-policy scoring report beside the loss. None is differentiated:
they ride the first pass over the slices as more per-token carries, and cost no pass of their
own (the vocabulary-chunk engine made them from each chunk's whole logits).

Per token, s and t the student's and the teacher's logits at T = 1 over the token columns
(a padded vocabulary's other columns count in none), y the target:

  teacher_nll  logsumexp(t) - t_y
  agreement    [argmax s = argmax t], the first maximum of each (as jnp.argmax)
  cosine       s . t / (|s| |t|), the raw logit vectors (the chunk engine's logit_cosine)
  reverse_kl   KL(Q || P) = sum_v q_v (s_v - t_v) - logsumexp(s) + logsumexp(t): the
               student-weighted sum of s - t, carried online beside the student's running
               maximum as slice_divergences carries a KL at T
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distillax.framework.slice_divergences import lse_step, weighted_step

METRICS = ("teacher_nll", "agreement", "cosine", "reverse_kl")


def init(N: int) -> dict[str, jax.Array]:
  neg, zero = jnp.full((N,), -jnp.inf, jnp.float32), jnp.zeros((N,), jnp.float32)
  return {"mt": neg, "lt": zero, "t_y": zero, "t_best": neg, "t_arg": jnp.zeros((N,), jnp.int32),
          "ms": neg, "ls": zero, "a": zero, "st": zero, "ss": zero, "tt": zero}


def step(carry, s_NxS, t_NxS, new_NxS, targets_N, start) -> dict[str, jax.Array]:
  """The carries after one more slice; s and t are -inf in the columns that do not count."""
  c = dict(carry)
  c["mt"], c["lt"] = lse_step(carry["mt"], carry["lt"], t_NxS)
  cols = start + jnp.arange(s_NxS.shape[-1])
  hit = (cols == targets_N[:, None]) & new_NxS
  c["t_y"] = carry["t_y"] + jnp.sum(jnp.where(hit, t_NxS, 0.0), axis=-1)
  best_j = jnp.max(t_NxS, axis=-1)
  better = best_j > carry["t_best"]  # strictly: an earlier slice keeps a tie (first maximum)
  c["t_best"] = jnp.where(better, best_j, carry["t_best"])
  c["t_arg"] = jnp.where(better, start + jnp.argmax(t_NxS, axis=-1).astype(jnp.int32),
                         carry["t_arg"])
  c["ms"], c["ls"], c["a"] = weighted_step(carry["ms"], carry["ls"], carry["a"], s_NxS,
                                           jnp.where(new_NxS, s_NxS - t_NxS, 0.0))
  s, t = jnp.where(new_NxS, s_NxS, 0.0), jnp.where(new_NxS, t_NxS, 0.0)
  c["st"] = carry["st"] + jnp.sum(s * t, axis=-1)
  c["ss"] = carry["ss"] + jnp.sum(s * s, axis=-1)
  c["tt"] = carry["tt"] + jnp.sum(t * t, axis=-1)
  return c


def sums(carry, student_arg_N, mask_N) -> dict[str, jax.Array]:
  """Each metric summed over the tokens whose mask is > 0 (`student_arg_N`: the student's first
  argmax, vocab_slices' accuracy carry)."""
  lse_t = carry["mt"] + jnp.log(carry["lt"])
  norms = jnp.sqrt(carry["ss"]) * jnp.sqrt(carry["tt"])
  values = {"teacher_nll": lse_t - carry["t_y"],
            "agreement": (student_arg_N == carry["t_arg"]).astype(jnp.float32),
            "cosine": carry["st"] / jnp.maximum(norms, 1e-30),
            "reverse_kl": carry["a"] / carry["ls"] - carry["ms"] - jnp.log(carry["ls"]) + lse_t}
  keep = mask_N > 0
  return {k: jnp.sum(jnp.where(keep, v, 0.0)) for k, v in values.items()}
