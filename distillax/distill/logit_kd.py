"""Logit distillation: soft targets from the teacher mixed with the hard-label cross-entropy.

Per real token (all math in fp32):

  loss = alpha * T^2 * D(teacher_T, student_T) + (1 - alpha) * CE(student, hard label)

where x_T = softmax(logits / T) and D is one of divergences.DIVERGENCES (teacher = P, student =
Q). The T^2 factor keeps the soft-target gradients on the scale of the hard-label ones when T
changes (Hinton et al., 2015). With `top_k`, the teacher is its top-k probabilities plus one rest
bucket (see divergences.py); the student stays normalised over the full vocabulary.

`CachedLogitKD` is the same loss with the teacher's top-k log-probabilities read from the batch
(an offline teacher cache, teacher_cache.py) instead of computed by a teacher in memory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from distillax.data import batch as batch_spec
from distillax.distill import divergences
from distillax.distill.base import LogitStrategy, check_common
from distillax.distill.logits import STUDENT, TEACHER, TokenLogits
from distillax.distill.sliced_teacher import sliced_teacher
from distillax.errors import ConfigError
from distillax.framework import losses, slice_teachers, slice_terms, token_rows, vocab_slices

# Batch keys an offline teacher cache adds (teacher_cache.py writes them, CachedLogitKD reads).
TOPK_IDS = "teacher_topk_ids_BxLxK"  # int32 token ids of the teacher's top-k at temperature T
TOPK_LOGPROBS = "teacher_topk_logprobs_BxLxK"  # float32 log softmax(teacher_logits / T) of those
TEACHER_NLL = "teacher_nll_BxL"  # float32 teacher NLL of the target (T = 1): the teacher_ce metric


def _check_kd_fields(s) -> None:
  owner = type(s).__name__
  check_common(s)
  if not isinstance(s.temperature, (int, float)) or not s.temperature > 0:
    raise ConfigError(f"{owner}.temperature={s.temperature!r} must be > 0 (2.0 is usual)")
  if not isinstance(s.alpha, (int, float)) or not 0.0 <= s.alpha <= 1.0:
    raise ConfigError(f"{owner}.alpha={s.alpha!r} must be in [0, 1] (weight of the soft targets)")
  if s.divergence not in divergences.DIVERGENCES:
    raise ConfigError(f"{owner}.divergence={s.divergence!r}; choose one of "
                      f"{', '.join(divergences.DIVERGENCES)}")
  if s.divergence == "jsd" and not (isinstance(s.beta, (int, float)) and 0.0 < s.beta < 1.0):
    raise ConfigError(f"{owner}.beta={s.beta!r} must be strictly between 0 and 1 for the "
                      f"generalised JSD (0.5 is the symmetric JSD)")


def soft_and_hard(kind: str, beta: float, temperature: float, alpha: float,
                  teacher_buckets_NxK: jax.Array, student_buckets_NxK: jax.Array,
                  logits: TokenLogits, prefix: str):
  """The per-token mix and its divergence, from bucketed log-probs at temperature T (the hard
  term's NLL comes from `logits`, shared with the hard_ce metric)."""
  div_N = divergences.divergence(kind, teacher_buckets_NxK, student_buckets_NxK, beta)
  loss_N = alpha * temperature ** 2 * div_N
  if alpha < 1.0:
    loss_N = loss_N + (1.0 - alpha) * logits.nll(STUDENT)
  return {prefix: loss_N, f"{prefix}_divergence": div_N}


@dataclasses.dataclass(frozen=True)
class LogitKD(LogitStrategy):
  """alpha * T^2 * D(teacher_T || student_T) + (1 - alpha) * CE(student, labels), per token.

  divergence: 'forward_kl' KL(teacher || student), 'reverse_kl' KL(student || teacher), or 'jsd'
    beta * KL(teacher || M) + (1 - beta) * KL(student || M), M = beta*teacher + (1-beta)*student.
  top_k: compare over the teacher's top-k tokens plus a rest bucket (teacher: 1 - top-k mass;
    student: its mass outside the teacher's top-k); None or >= vocab: the full vocabulary.
  Reports `{name}` (the mixed per-token loss) and `{name}_divergence` (D alone, without T^2).
  """

  temperature: float = 2.0
  alpha: float = 0.7
  divergence: str = "forward_kl"
  beta: float = 0.5
  top_k: int | None = None
  weight: float = 1.0
  name: str = "logit_kd"

  def __post_init__(self):
    _check_kd_fields(self)
    if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                   or self.top_k <= 0):
      raise ConfigError(f"LogitKD.top_k={self.top_k!r} must be a positive integer or None")

  def shared_token_values(self, logits: TokenLogits):
    if logits.teacher is None:
      raise ConfigError(f"LogitKD {self.name!r} needs an online teacher; use CachedLogitKD to "
                        f"train from an offline teacher cache")
    T = float(self.temperature)
    s_logp_NxV = logits.log_probs(STUDENT, T)
    t_logp_NxV = logits.log_probs(TEACHER, T)
    V = logits.vocab_size
    if self.top_k is None or self.top_k >= V:
      t_buckets, s_buckets = t_logp_NxV, s_logp_NxV
    else:
      top_logp_NxK, top_ids_NxK = jax.lax.top_k(t_logp_NxV, self.top_k)
      t_buckets = divergences.teacher_buckets(top_logp_NxK, V)
      s_buckets = divergences.student_buckets(s_logp_NxV, top_ids_NxK)
    return soft_and_hard(self.divergence, self.beta, T, self.alpha, t_buckets, s_buckets,
                         logits, self.name)


@dataclasses.dataclass(frozen=True)
class CachedLogitKD(LogitStrategy):
  """LogitKD against an offline teacher cache: no teacher in memory.

  The batch carries the teacher's top-k ids and log-probabilities at the cache's temperature
  (TOPK_IDS, TOPK_LOGPROBS; teacher_cache.py). `temperature` must equal the temperature the
  cache was written with (`read_teacher_cache(..., temperature=...)` checks; `from_cache_info`
  copies it). Missing mass is the same rest bucket as LogitKD(top_k=K), so with the same K and T
  both give the same loss (up to fp32 rounding).
  """

  temperature: float = 2.0
  alpha: float = 0.7
  divergence: str = "forward_kl"
  beta: float = 0.5
  weight: float = 1.0
  name: str = "logit_kd"

  def __post_init__(self):
    _check_kd_fields(self)

  @classmethod
  def from_cache_info(cls, info, **kwargs) -> "CachedLogitKD":
    if getattr(info, "kind", "topk") != "topk":
      raise ConfigError(f"CachedLogitKD reads a top-k cache, this one holds kind={info.kind!r}; "
                        f"use LogitKD with the cache's TeacherHead as the teacher "
                        f"(teacher_head.load_head)")
    return cls(temperature=info.temperature, **kwargs)

  reads_teacher = False  # the teacher's top-k is in the batch

  def shared_token_values(self, logits: TokenLogits):
    tokens = logits.tokens
    if TOPK_IDS not in tokens or TOPK_LOGPROBS not in tokens:
      raise ConfigError(f"CachedLogitKD {self.name!r}: the batch has no {TOPK_IDS}/"
                        f"{TOPK_LOGPROBS}; feed batches from "
                        f"distill.teacher_cache.read_teacher_cache")
    T = float(self.temperature)
    s_logp_NxV = logits.log_probs(STUDENT, T)
    V = logits.vocab_size
    ids_NxK = tokens[TOPK_IDS].astype(jnp.int32)
    t_buckets = divergences.teacher_buckets(tokens[TOPK_LOGPROBS].astype(jnp.float32), V)
    s_buckets = divergences.student_buckets(s_logp_NxV, ids_NxK)
    return soft_and_hard(self.divergence, self.beta, T, self.alpha, t_buckets, s_buckets,
                         logits, self.name)


# The logit metrics that cost passes over the vocabulary beyond what the losses make: computed
# by eval objectives (`make_distill_objective(..., metrics=True)`), not by every train step.
EXTRA_METRICS = ("teacher_ce", "top1_agreement", "logit_cosine")


def logit_metric_values(s_logits_NxV, t_logits_NxV, tokens) -> dict[str, jax.Array]:
  """Per-token metrics every distillation eval reports (sums become means in the step).

  hard_ce: student NLL of the label (perplexity = exp(mean hard_ce)); teacher_ce: the teacher's
  (from the cache's TEACHER_NLL without an online teacher); top1_agreement: 1 where student and
  teacher argmax agree (the cached top-1 offline); logit_cosine: cosine similarity of the two
  raw logit vectors (online teacher only: a cache holds no full logits).
  """
  return shared_metric_values(TokenLogits(s_logits_NxV, t_logits_NxV, tokens))


def shared_metric_values(logits: TokenLogits, extra: bool = True) -> dict[str, jax.Array]:
  """`logit_metric_values` from shared reductions; extra=False: hard_ce alone (its NLL is the
  one the hard-label term already computes, so a train step pays no pass for it)."""
  out = {"hard_ce": logits.nll(STUDENT)}
  if extra:
    out.update(_extra_metric_values(logits))
  return jax.tree.map(jax.lax.stop_gradient, out)


def _extra_metric_values(logits: TokenLogits) -> dict[str, jax.Array]:
  s, t, tokens = logits.student, logits.teacher, logits.tokens
  s_top1 = jnp.argmax(s, axis=-1)
  out = {}
  if t is not None:
    out["teacher_ce"] = logits.nll(TEACHER)
    out["top1_agreement"] = (s_top1 == jnp.argmax(t, axis=-1)).astype(jnp.float32)
    s, t = token_rows.zeroed(s), token_rows.zeroed(t)  # over the token columns alone
    norms = jnp.sqrt(jnp.sum(s * s, axis=-1)) * jnp.sqrt(jnp.sum(t * t, axis=-1))
    out["logit_cosine"] = jnp.sum(s * t, axis=-1) / jnp.maximum(norms, 1e-30)
  else:
    if TEACHER_NLL in tokens:
      out["teacher_ce"] = tokens[TEACHER_NLL].astype(jnp.float32)
    if TOPK_IDS in tokens:
      out["top1_agreement"] = (s_top1 == tokens[TOPK_IDS][:, 0]).astype(jnp.float32)
  return out


def sliced_leaves(token_leaves, teachers) -> tuple | None:
  """The (weight, LogitKD or CachedLogitKD) pairs that train.loss_impl='sliced' computes (None
  for a strategy with no logit term: its metrics alone, `sliced_metric_sums`), or a one-line
  refusal. One leaf: any divergence, over the whole vocabulary or a top-k, from one teacher
  (live, a hidden-state cache's head or a top-k cache of any K) or several (`teachers`, mixed
  or routed: a LogitKD), with the metrics of train and eval objectives (hard_ce; a teacher model's
  teacher_ce, top1_agreement and logit_cosine from slice_metrics; a top-k cache's teacher_ce
  and top-1 agreement). Several leaves (a Composite of LogitKDs, each its own temperature,
  divergence, alpha and weight: framework/slice_terms.py): LogitKDs over the whole vocabulary,
  from the teacher models as one leaf takes them; a top-k or a cache's top-k among several is
  refused (each would need its own bucket pass)."""
  if not token_leaves:
    return None
  names = ", ".join(f"{type(leaf).__name__}({leaf.name})" for _, leaf in token_leaves)
  if len(token_leaves) == 1:
    if not isinstance(token_leaves[0][1],
                      LogitKD if teachers is not None else (LogitKD, CachedLogitKD)):
      raise ConfigError(f"train.loss_impl='sliced' computes LogitKD terms; this job has "
                        f"{names}: set --config.train.loss_impl=chunked")
    return tuple(token_leaves)
  if not all(isinstance(leaf, LogitKD) and leaf.top_k is None for _, leaf in token_leaves):
    raise ConfigError(f"train.loss_impl='sliced' computes several logit terms as LogitKDs over "
                      f"the whole vocabulary (no top_k, no cache); this job has {names}: set "
                      f"--config.train.loss_impl=chunked")
  return tuple(token_leaves)


def _sliced_teacher(leaf, inputs, student_vocab: int, teachers):
  """(the teacher and its flat input (sliced_teacher.py), or None; the teacher's given top-k, or
  None; top_k). A top-k cache of every id is a whole distribution: its log-probs at T are
  scattered once into vocabulary order (a table the cache's size), times T, as the teacher's
  logits (slice_teachers.Table), and it is read as a live teacher's over the whole vocabulary."""
  flat = losses.flat_tokens
  if isinstance(leaf, CachedLogitKD):
    ids, logp = flat(inputs.batch[TOPK_IDS]), flat(inputs.batch[TOPK_LOGPROBS])
    if ids.shape[-1] < student_vocab:
      return None, (ids, logp), ids.shape[-1]
    rows = jnp.arange(ids.shape[0])[:, None]
    table = jnp.full((ids.shape[0], student_vocab), token_rows.MASKED_LOGIT, jnp.float32).at[
        rows, ids].set(float(leaf.temperature) * logp.astype(jnp.float32), mode="drop")
    return (slice_teachers.Table(table), None), None, 0
  if inputs.teacher_model is None:
    raise ConfigError("train.loss_impl='sliced' needs the teacher's output layer; set "
                      "--config.train.loss_impl=chunked")
  head = sliced_teacher(inputs.teacher_model, inputs.teacher.final_hidden_BxLxD, teachers,
                        inputs.batch)
  return head, None, leaf.top_k if leaf.top_k is not None and leaf.top_k < student_vocab else 0


def _spec(leaves, top_k: int, bucket_divergence, metrics: bool, teacher: bool):
  """One leaf's Spec as it always was; several leaves' terms (slice_terms.Term), whose hard-label
  weight is the sum of each leaf's weight * (1 - alpha)."""
  kd = [(w * float(leaf.alpha) * float(leaf.temperature) * float(leaf.temperature),
         float(leaf.temperature), leaf) for w, leaf in leaves]
  ce = sum(w * (1.0 - float(leaf.alpha)) for w, leaf in leaves)
  if len(leaves) > 1:
    terms = tuple(slice_terms.Term(kd_weight=k, temperature=T, divergence=leaf.divergence,
                                   beta=float(leaf.beta)) for k, T, leaf in kd)
    return vocab_slices.Spec(ce_weight=ce, terms=terms, accuracy=metrics,
                             metrics=metrics and teacher)
  k, T, leaf = kd[0]
  return vocab_slices.Spec(kd_weight=k, ce_weight=ce, temperature=T, divergence=leaf.divergence,
                           beta=float(leaf.beta), top_k=top_k, bucket_divergence=bucket_divergence,
                           accuracy=metrics, metrics=metrics and teacher)


def sliced_loss_and_sums(leaves, inputs, metrics: bool = False, teachers=None
                         ) -> tuple[jax.Array, dict]:
  """The (weight, LogitKD) pairs' weighted loss and their sums (the chunked path's names: each
  leaf's `{name}` and `{name}_divergence`, hard_ce) over vocabulary slices; with metrics also
  teacher_ce and top1_agreement (a cache's, or a teacher model's with its logit_cosine:
  slice_metrics.py). `teachers`: several, folded (TeacherMix)."""
  mask_BxL = inputs.batch[batch_spec.LOSS_MASK]
  flat = losses.flat_tokens
  student, h_s = losses.sliced_head(inputs.student_model, inputs.student.final_hidden_BxLxD)
  leaf = leaves[0][1]
  teacher, given, top_k = _sliced_teacher(leaf, inputs, student.vocab, teachers)
  buckets = functools.partial(_bucket_divergence, leaf.divergence, float(leaf.beta),
                              student.vocab) if top_k else None
  spec = _spec(leaves, top_k, buckets, metrics, teacher is not None)
  loss, sums = vocab_slices.token_sums(
      spec, student, h_s, flat(inputs.batch[batch_spec.TARGETS]), flat(mask_BxL),
      *(teacher or (None, None)), teacher_top=given)
  losses.token_loss_impl.record(vocab_slices.describe(spec, student, mask_BxL.size,
                                                      teacher=teacher is not None))
  out = {"hard_ce": sums["nll"]}
  divs = sums["divergences"] if spec.terms else (sums["divergence"],)
  for (_, leaf), div in zip(leaves, divs):
    T, a = float(leaf.temperature), float(leaf.alpha)
    out.update({leaf.name: a * T * T * div + (1.0 - a) * sums["nll"],
                f"{leaf.name}_divergence": div})
  if metrics:  # a cache's: its top-1 (a whole cache's table: its argmax) and its own NLL
    out["top1_agreement"] = sums["agreement"]
    if not isinstance(leaves[0][1], CachedLogitKD):
      out.update(teacher_ce=sums["teacher_nll"], logit_cosine=sums["cosine"])
    elif TEACHER_NLL in inputs.batch:
      nll = inputs.batch[TEACHER_NLL].astype(jnp.float32)
      out["teacher_ce"] = jnp.sum(jnp.where(mask_BxL > 0, nll, 0.0))
  return loss, out


def sliced_metric_sums(inputs, metrics: bool, teachers=None) -> tuple[jax.Array, dict]:
  """(0, the sums an objective with no logit term reports) over vocabulary slices: hard_ce, and
  with metrics and a teacher's output its teacher_ce, top1_agreement and logit_cosine (the
  chunked path's names). Metrics only: nothing is differentiated, so no backward pass runs."""
  mask_BxL = inputs.batch[batch_spec.LOSS_MASK]
  flat = losses.flat_tokens
  hidden = jax.lax.stop_gradient(inputs.student.final_hidden_BxLxD)
  student, h_s = losses.sliced_head(inputs.student_model, hidden)
  teacher = None
  if metrics and inputs.teacher is not None:
    teacher = sliced_teacher(inputs.teacher_model, inputs.teacher.final_hidden_BxLxD, teachers,
                             inputs.batch)
  spec = vocab_slices.Spec(ce_weight=0.0, accuracy=teacher is not None,
                           metrics=teacher is not None)
  _, sums = vocab_slices.token_sums(spec, student, h_s, flat(inputs.batch[batch_spec.TARGETS]),
                                    flat(mask_BxL), *(teacher or (None, None)))
  losses.token_loss_impl.record(vocab_slices.describe(spec, student, mask_BxL.size,
                                                      teacher=teacher is not None))
  out = {"hard_ce": sums["nll"]}
  if teacher is not None:
    out.update(teacher_ce=sums["teacher_nll"], top1_agreement=sums["agreement"],
               logit_cosine=sums["cosine"])
  return jnp.zeros((), jnp.float32), out


def _bucket_divergence(kind: str, beta: float, vocab: int, t_top_logp_NxK, s_buckets_NxK1):
  """LogitKD(top_k)'s divergence from the teacher's top-k log-probs and the student's buckets
  (what vocab_slices' top-k pass hands it)."""
  return divergences.divergence(kind, divergences.teacher_buckets(t_top_logp_NxK, vocab),
                                s_buckets_NxK1, beta)
