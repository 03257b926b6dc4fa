"""The two per-token losses of on-policy distillation, as token-level strategies.

Both read the student's and the teacher's logits at the positions of a completion the student
sampled (objective.py builds that batch); the objective evaluates them in the one shared pass
over the vocabulary, whole or a chunk of tokens at a time (framework/vocab_chunks.py), so a 128k
vocabulary never holds [tokens, V] fp32 logits for the whole batch.

`GeneralizedJSD` (GKD, Agarwal et al. 2024): over the full vocabulary, at temperature T,
  beta = 0:      KL(P || Q)                                 forward KL (mass-covering)
  0 < beta < 1:  beta KL(P || M) + (1 - beta) KL(Q || M),   M = beta P + (1 - beta) Q
  beta = 1:      KL(Q || P)                                 reverse KL (mode-seeking)
with P = softmax(teacher / T), Q = softmax(student / T). The end points are the limits GKD names
(JSD(beta) / beta -> forward KL as beta -> 0, JSD(beta) / (1 - beta) -> reverse KL as beta -> 1),
the convention TRL's GKDTrainer also follows. No T^2 factor (unlike LogitKD): GKD compares the
tempered distributions themselves.

`SampledTokenKL` (the tinker-cookbook recipe): per sampled token y, with the learner's
log-probability log q(y) (student forward, differentiable), the teacher's log p(y) and the
sampler's log q_s(y) (what the token was drawn from: temperature, top-k/top-p), all at the
divergence temperature,

  advantage A = -(log q(y) - log p(y))           (behind stop_gradient)
  loss        = -A * exp(log q(y) - log q_s(y))  (an importance-weighted policy gradient)

Its value is the sampled estimate of reverse KL where q = q_s; its gradient is
-A * (q / q_s) * grad log q, whose expectation over y ~ q_s is sum_y q (log q - log p) grad log q
= grad KL(Q || P) (as sum_y q grad log q = 0). Only the immediate token's KL is the advantage
(no credit from later tokens), as in the recipe. It costs no pass over the vocabulary beyond
the two log-normalisers.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from distillax.distill import divergences
from distillax.distill.base import LogitStrategy, Strategy, check_common
from distillax.distill.logits import STUDENT, TEACHER, TokenLogits
from distillax.errors import ConfigError

# Batch key of the sampler's log-probability of each target token (the completion tokens),
# aligned with targets_BxL; SampledTokenKL reads it.
SAMPLE_LOGPROBS = "sample_logprobs_BxL"


def generalized_jsd(teacher_logp: jax.Array, student_logp: jax.Array, beta: float) -> jax.Array:
  """JSD(beta) per row of log-probabilities (teacher = P, student = Q), see the module doc."""
  beta = float(beta)
  if beta == 0.0:
    return divergences.kl(teacher_logp, student_logp)
  if beta == 1.0:
    return divergences.kl(student_logp, teacher_logp)
  log_m = jnp.logaddexp(math.log(beta) + teacher_logp, math.log1p(-beta) + student_logp)
  return (beta * divergences.kl(teacher_logp, log_m)
          + (1.0 - beta) * divergences.kl(student_logp, log_m))


def sampled_token_surrogate(learner_logp_N: jax.Array, teacher_logp_N: jax.Array,
                            sampler_logp_N: jax.Array) -> jax.Array:
  """The per-token policy-gradient loss of SampledTokenKL (see the module doc)."""
  advantage_N = -jax.lax.stop_gradient(learner_logp_N - teacher_logp_N)
  ratio_N = jnp.exp(learner_logp_N - jax.lax.stop_gradient(sampler_logp_N))
  return -advantage_N * ratio_N


def _check_temperature(s) -> None:
  if not isinstance(s.temperature, (int, float)) or not s.temperature > 0:
    raise ConfigError(f"{type(s).__name__}.temperature={s.temperature!r} must be > 0 (1.0 "
                      f"compares the models' own distributions)")


def target_logprob(logits: TokenLogits, model: str, temperature: float) -> jax.Array:
  """log softmax(x / T) of each target (N,), without forming [N, V] log-probs at T = 1."""
  if float(temperature) == 1.0:
    return -logits.nll(model)
  logp_NxV = logits.log_probs(model, temperature)
  return jnp.take_along_axis(logp_NxV, logits.targets_N[:, None], axis=-1)[:, 0]


@dataclasses.dataclass(frozen=True)
class GeneralizedJSD(LogitStrategy):
  """JSD(beta) between teacher and student over the full vocabulary at `temperature`."""

  beta: float = 0.5
  temperature: float = 1.0
  weight: float = 1.0
  name: str = "gjsd"

  def __post_init__(self):
    check_common(self)
    _check_temperature(self)
    if not isinstance(self.beta, (int, float)) or not 0.0 <= self.beta <= 1.0:
      raise ConfigError(f"GeneralizedJSD.beta={self.beta!r} must be in [0, 1] (0 forward KL, "
                        f"1 reverse KL, 0.5 the symmetric JSD)")

  def shared_token_values(self, logits: TokenLogits):
    T = float(self.temperature)
    value_N = generalized_jsd(logits.log_probs(TEACHER, T), logits.log_probs(STUDENT, T),
                              self.beta)
    return {self.name: value_N}


@dataclasses.dataclass(frozen=True)
class SampledTokenKL(LogitStrategy):
  """Reverse KL through the sampled tokens: an importance-weighted policy gradient whose
  per-token advantage is -(log q - log p) (see the module doc). The batch carries the
  sampler's log-probabilities of the targets under SAMPLE_LOGPROBS."""

  temperature: float = 1.0
  weight: float = 1.0
  name: str = "sampled_kl"

  def __post_init__(self):
    check_common(self)
    _check_temperature(self)

  def shared_token_values(self, logits: TokenLogits):
    if SAMPLE_LOGPROBS not in logits.tokens:
      raise ConfigError(f"SampledTokenKL {self.name!r}: the batch has no {SAMPLE_LOGPROBS}; "
                        f"it scores samples the on-policy objective draws (objective.py)")
    T = float(self.temperature)
    learner_N = target_logprob(logits, STUDENT, T)
    teacher_N = jax.lax.stop_gradient(target_logprob(logits, TEACHER, T))
    sampler_N = logits.tokens[SAMPLE_LOGPROBS].astype(jnp.float32)
    return {self.name: sampled_token_surrogate(learner_N, teacher_N, sampler_N)}


DIVERGENCES = ("gjsd", "sampled_kl")


def on_policy_strategy(divergence: str, *, beta: float = 0.5, temperature: float = 1.0
                       ) -> Strategy:
  """The loss the `on_policy.divergence` field names."""
  if divergence == "gjsd":
    return GeneralizedJSD(beta=beta, temperature=temperature)
  if divergence == "sampled_kl":
    return SampledTokenKL(temperature=temperature)
  raise ConfigError(f"on_policy.divergence={divergence!r} is unknown; use one of "
                    f"{', '.join(DIVERGENCES)}")


__all__ = ["DIVERGENCES", "GeneralizedJSD", "SAMPLE_LOGPROBS", "SampledTokenKL",
           "generalized_jsd", "on_policy_strategy", "sampled_token_surrogate", "target_logprob"]
