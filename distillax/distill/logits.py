"""One pass over the vocabulary per model and temperature, shared by every term and metric.

At a real vocabulary (Llama 3: 128,256 tokens) each reduction over V of a [tokens, V] array is a
full trip through memory and, with a softmax, V exponentials per token. The logit terms and
metrics read the same few quantities (log-softmax of each model at temperature T, NLL of the
label), so `TokenLogits` computes each once, when first asked, and hands the same arrays to
every reader:

  max over V: once per model, shared by every temperature (dividing by T > 0 is monotonic, so
    max(x / T) is max(x) / T exactly);
  log-sum-exp over V: once per (model, temperature);
  NLL of the label: the T = 1 log-sum-exp minus the label's shifted logit (a gather, no pass).

The arithmetic is that of `jax.nn.log_softmax(x / T)` operation for operation, so values are
bit-identical to computing each softmax separately; only the repeated passes are gone.

Padded vocabulary rows (a model's rows past its tokenizer's ids: the byte tokenizer's 259 ids in
384 rows, Qwen's 151,936 rows for 151,669 tokens) are kept: every distribution here, student's
and teacher's, and next-token CE (framework/vocab_chunks.py) normalise over all V rows, as the
model's own softmax does wherever it runs (transformers, llama.cpp: neither masks them). No
target is ever a padded id (data holds tokenizer ids; models/sampler.py never draws one), so
the rows only enter as probability mass: CE and reverse KL push the student's mass there down,
forward KL matches it to the teacher's (next to nothing for a trained teacher). Restricting the
distributions to the real ids would leave those rows without gradient, at their initial values,
for a runtime that does not mask them to emit. The sampler's renormalisation over real ids is
the one place they are dropped, so SampledTokenKL's importance weight exp(log p_learner - log
q_sampler), sampling at temperature 1 unfiltered, is 1 minus the student's mass on padded rows
(next to 1 once it is trained).
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from distillax.data import batch as batch_spec

STUDENT, TEACHER = "student", "teacher"


class TokenLogits:
  """Student (and teacher) logits of N token positions, with memoised per-token reductions.

  student / teacher: fp32 [N, V] (teacher None without an online teacher, e.g. from a cache);
  tokens: the batch entries flattened to (N, ...) (targets, loss mask, cached teacher columns).
  """

  def __init__(self, s_logits_NxV: jax.Array, t_logits_NxV: jax.Array | None,
               tokens: Mapping[str, jax.Array]):
    self.student = s_logits_NxV.astype(jnp.float32)
    self.teacher = None if t_logits_NxV is None else t_logits_NxV.astype(jnp.float32)
    self.tokens = tokens
    self._memo: dict[tuple, jax.Array] = {}

  @property
  def vocab_size(self) -> int:
    return self.student.shape[-1]

  @property
  def targets_N(self) -> jax.Array:
    return self.tokens[batch_spec.TARGETS].astype(jnp.int32)

  def _cached(self, key: tuple, compute: Callable[[], jax.Array]) -> jax.Array:
    if key not in self._memo:
      self._memo[key] = compute()
    return self._memo[key]

  def logits(self, model: str) -> jax.Array:
    x = self.student if model == STUDENT else self.teacher
    if x is None:
      raise ValueError("no teacher logits here (an offline cache holds none)")
    return x

  def max(self, model: str) -> jax.Array:
    """max over V (N, 1), behind stop_gradient as in jax.nn.log_softmax: one pass per model."""
    return self._cached(("max", model), lambda: jax.lax.stop_gradient(
        jnp.max(self.logits(model), axis=-1, initial=-jnp.inf, keepdims=True)))

  def shifted(self, model: str, temperature: float = 1.0) -> jax.Array:
    """x / T - max(x / T): elementwise, fused into its readers (no pass of its own)."""
    T = float(temperature)
    if T == 1.0:
      return self._cached(("shifted", model, T), lambda: self.logits(model) - self.max(model))
    return self._cached(("shifted", model, T),
                        lambda: self.logits(model) / T - self.max(model) / T)

  def log_normaliser(self, model: str, temperature: float = 1.0) -> jax.Array:
    """log sum exp(shifted) (N, 1): one pass per model and temperature."""
    T = float(temperature)
    return self._cached(("lse", model, T), lambda: jnp.log(
        jnp.sum(jnp.exp(self.shifted(model, T)), axis=-1, keepdims=True)))

  def log_probs(self, model: str, temperature: float = 1.0) -> jax.Array:
    """log softmax(x / T) [N, V]."""
    T = float(temperature)
    return self._cached(("logp", model, T), lambda: self.shifted(model, T)
                        - self.log_normaliser(model, T))

  def nll(self, model: str = STUDENT) -> jax.Array:
    """Negative log-likelihood of each target at T = 1 (N,): the shifted logit of the label
    minus the log normaliser, without forming the T = 1 log-softmax."""
    def compute():
      label_N = jnp.take_along_axis(self.shifted(model), self.targets_N[:, None], axis=-1)[:, 0]
      return -(label_N - self.log_normaliser(model)[:, 0])
    return self._cached(("nll", model), compute)
