"""Token losses over slices of the vocabulary: every position's logits for a slice of columns at
a time, for the losses that need only per-token normalisers and sums over the vocabulary:
next-token cross-entropy and logit distillation (LogitKD's forward KL, reverse KL or jsd at a
temperature, slice_divergences.py; over the teacher's top-k and a rest bucket, slice_buckets.py,
the top-k found over the teacher's slices or read from an offline cache (one of every id: a
table of logits); on-policy GeneralizedJSD as a divergence with no hard-label term), several
such terms in one pass (a Composite of LogitKDs, each its own temperature: slice_terms.py), a
per-token function of both models' target log-probabilities (on-policy SampledTokenKL,
slice_targets.py), and the metrics an eval or on-policy scoring reports of both models' logits
(slice_metrics.py: no gradient). The head's matmuls and the slices' geometry are
slice_heads.py's, the teacher side (one head, several teachers mixed or routed per token, or a
table) slice_teachers.py's. What still runs on the token chunks of vocab_chunks.py, and why,
its docstring says: cross-tokenizer ULD for a capability reason (it sorts each row's whole
distribution), a top-k among several terms, and train.loss_impl='chunked' chosen by hand.

Why a second schedule beside the token chunks of vocab_chunks.py. A token chunk sees the whole
vocabulary for a few hundred positions, so the output layer's weight gradient, a (V, D) fp32
array, is read and written once per chunk: on a TPU v5e at vocabulary 151,936 that traffic was
157 ms of a 1,070 ms train step (benchmarks/results/tpu/levers_call1.jsonl). A vocabulary slice
sees every position for a few thousand columns: its slice of the weight gradient is written
once, and what is carried from slice to slice is per token: the running maximum, the sum of
exponentials, and for KD a weighted difference of the two models' logits (online softmax, as
flash attention keeps it; a jsd takes a second pass once both normalisers are known). The
backward pass recomputes each slice's logits from the saved log-sum-exps, so nothing of size
(tokens, V) is ever held.

Per token (fp32), s and t the student's and teacher's logits, y the target, T the temperature:
  nll = logsumexp(s) - s_y
  loss = kd_weight * D(softmax(t / T), softmax(s / T)) + ce_weight * nll
         (masked; LogitKD: kd_weight = alpha T^2; D and its gradient: slice_divergences.py,
         or Spec.target_term's f of the target's log-probabilities: slice_targets.py)
and d loss / d s_v = kd_weight d D / d s_v + ce_weight (softmax(s)_v - [v = y]). The output
layer: logits = softcap(h @ W + sum_i x_i @ B_i) with W the
tied embedding (V, D) or the head (D, V), read as the step multiplies it (a QAT head's rounded
weight and rounded input), and the extra matmuls (`Head.more`) a LoRA adapter on it adds
(x = scaling * dropout(h) @ A, B (rank, V)): the model gives its operands
(`Transformer.output_operands`), so an adapted or fake-quantized student's logits are its own.
A weight the caller does not differentiate (a LoRA base, a frozen tied embedding) gets no
gradient accumulator and no weight-sized matmul per slice in the backward pass.

A padded vocabulary (the student head's `token_rows` < V, framework/token_rows.py): its columns
past the tokens leave every sum above, of both models (the teacher's columns are the student's),
and get a zero gradient, by the per-slice column mask that already leaves out the last slice's
overlap: the slices are the same, and no array of its own is formed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import custom_derivatives

from distillax.framework import (slice_buckets, slice_divergences, slice_metrics, slice_targets,
                                 slice_teachers, slice_terms, vocab_stats_kernel)
from distillax.framework.slice_heads import (SLICE_BUDGET_BYTES, Head, new_columns, parts,
                                             slice_count, slice_size_for, sliced_parts, slices)
from distillax.framework.slice_heads import logits as slice_logits


@dataclasses.dataclass(frozen=True)
class Spec:
  """What the loss weighs (static): kd_weight * divergence at `temperature` + ce_weight * nll;
  the divergence one of slice_divergences.DIVERGENCES (beta: the jsd's teacher weight)."""

  kd_weight: float = 0.0
  ce_weight: float = 1.0
  temperature: float = 1.0
  divergence: str = "forward_kl"
  beta: float = 0.5
  # > 0: the divergence over the teacher's top-k tokens plus a rest bucket (slice_buckets.py),
  # computed by `bucket_divergence(teacher top-k log-probs (N, K), student buckets (N, K + 1))`.
  top_k: int = 0
  bucket_divergence: Any = None
  accuracy: bool = False  # also count argmax hits (the first maximum, as jnp.argmax)
  metrics: bool = False  # also sum slice_metrics.METRICS (needs the teacher's head; accuracy too)
  # Not None: the KD term is `target_term(log q_T(y), log p_T(y), x)` per token instead of the
  # divergence (slice_targets.py; x: token_sums' target_input_N).
  target_term: Any = None
  terms: tuple = ()  # several KD terms in one pass, kd_weight 0 (slice_terms.py: 'divergences')
  slice_size: int = 0  # columns per slice; 0: from SLICE_BUDGET_BYTES


def _kernel_runs(spec: Spec, teacher: bool, tokens: int, parts: int, softcap) -> bool:
  """Whether the first pass is vocab_stats_kernel's: cross-entropy alone (no teacher's head, no
  given top-k) over a head the kernel takes."""
  return not teacher and not spec.top_k and vocab_stats_kernel.applies(tokens, parts, softcap)


def describe(spec: Spec, head: Head, tokens: int, teacher: bool = False) -> str:
  """How the loss ran, for plan's report (`teacher`: a teacher's head rode the slices)."""
  size = slice_size_for(tokens, head.vocab, spec.slice_size)
  kernel = _kernel_runs(spec, teacher, tokens, 1 + len(head.more), head.softcap)
  return (f"sliced (vocabulary slices: {math.ceil(head.vocab / size)} of {size} columns x "
          f"{tokens} positions" + ("; the forward pass one Pallas kernel over the whole "
                                   "vocabulary, vocab_stats_kernel.py" if kernel else "") + ")")


def token_sums(spec: Spec, student: Head, h_s_NxD, targets_N, mask_N,
               teacher=None, h_t_NxD=None, teacher_top=None, target_input_N=None):
  """(loss, sums): loss = sum over masked tokens of the weighted terms (differentiable in the
  student's weight and hidden states); sums of 'nll', 'divergence' (with a teacher) and
  'correct' (with spec.accuracy; 'agreement' too with a top-k teacher: the student's argmax is
  the teacher's top-1) over the masked tokens, as metrics. teacher: a Head (its flat input
  h_t_NxD) or several folded into one (slice_teachers.Teachers, their inputs inside).
  teacher_top: the teacher's top-k (ids (N, K), log-probs at T (N, K)) given instead of its
  head (an offline cache)."""
  given = teacher_top is not None
  if teacher is None and not given and spec.kd_weight:
    raise ValueError("kd_weight > 0 needs a teacher")
  slice_divergences.check(spec.divergence, spec.beta)
  if given != bool(spec.top_k and teacher is None):
    raise ValueError("spec.top_k takes the teacher's head or its given top-k, one of them")
  if spec.top_k and spec.bucket_divergence is None:
    raise ValueError("top_k > 0 needs a bucket_divergence")
  if spec.metrics and (teacher is None or not spec.accuracy):
    raise ValueError("spec.metrics needs the teacher's head and spec.accuracy")
  if spec.target_term is not None and (teacher is None or spec.top_k or target_input_N is None):
    raise ValueError("spec.target_term needs the teacher's head, no top_k and a target_input_N")
  if spec.terms and (teacher is None or spec.top_k or spec.target_term or spec.kd_weight):
    raise ValueError("spec.terms needs the teacher's head, no top_k, target_term or kd_weight")
  slice_terms.check(spec.terms)
  size = slice_size_for(h_s_NxD.shape[0], student.vocab, spec.slice_size)
  w_s, h_s, axes = parts(student, h_s_NxD)
  w_t = h_t = t_static = None
  if teacher is not None:  # one head, or several folded (slice_teachers.py)
    t_static, w_t, h_t = slice_teachers.operands(teacher, h_t_NxD, size, student.vocab,
                                                 student.columns)
  static = (spec, size, axes, student.dtype, student.softcap, student.columns, t_static)
  top = None if not given else (teacher_top[0].astype(jnp.int32),
                                jax.lax.stop_gradient(teacher_top[1].astype(jnp.float32)))
  x_N = None if target_input_N is None else jax.lax.stop_gradient(
      target_input_N.astype(jnp.float32))
  loss, sums = _sliced(static, w_s, h_s, w_t, h_t, top, x_N, targets_N,
                       mask_N.astype(jnp.float32))
  return loss, jax.tree.map(jax.lax.stop_gradient, sums)


# ---- the forward pass: one scan over the slices, online statistics per token -------------------

def _forward(static, w_s, h_s, w_t, h_t, top, x_N, targets_N, mask_N):
  """(loss, sums, what the backward pass reads per token) after the passes over the slices: one,
  and a second for a jsd (its per-column terms need both normalisers first) or for top-k
  buckets (the student's logits at the teacher's top-k ids, known after the first)."""
  spec = static[0]
  st = _stats(static, w_s, h_s, w_t, h_t, targets_N)
  lse = {"s1": st["m1"] + jnp.log(st["l1"])}
  kd = w_t is not None or top is not None
  if top is not None:  # the teacher's top-k given: log-probs already
    lse["sT"] = st["kd"]["mq"] + jnp.log(st["kd"]["lq"])
    lse["kl"], saved = _bucket_pass(static, w_s, h_s, top[0], top[1], lse)
    lse.update(saved)
  elif w_t is not None and spec.terms:
    lse["terms"] = slice_terms.values(spec.terms, st["kd"], functools.partial(
        _over_slices, static, w_s, h_s, w_t, h_t))
  elif w_t is not None:
    lse.update(slice_divergences.normalisers(st["kd"]))
    if spec.top_k:
      t_top_logp = st["top"]["top"] - lse["t"][:, None]
      lse["kl"], saved = _bucket_pass(static, w_s, h_s, st["top"]["ids"], t_top_logp, lse)
      lse.update(saved)
    elif spec.target_term is not None:  # zeros off the mask: x there may be anything
      lse["kl"], lse["c"] = jax.tree.map(
          lambda v: jnp.where(mask_N > 0, v, 0.0), slice_targets.value_and_coefficient(
              spec.target_term, st["target"], st["t_target"], lse, x_N, spec.temperature))
    elif spec.divergence == "jsd":
      lse["kl"], lse["jq"] = _jsd_pass(static, w_s, h_s, w_t, h_t, lse)
    else:
      lse["kl"] = slice_divergences.kl_value(spec.divergence, st["kd"], lse)
  nll = lse["s1"] - st["target"]
  sums = {"nll": jnp.sum(nll * mask_N)}
  loss_N = spec.ce_weight * nll
  if kd and spec.terms:
    kd_N, sums["divergences"] = slice_terms.loss_and_sums(spec.terms, lse["terms"], mask_N)
    loss_N = loss_N + kd_N
  elif kd:
    sums["divergence"] = jnp.sum(lse["kl"] * mask_N)
    loss_N = loss_N + spec.kd_weight * lse["kl"]
  if spec.accuracy:
    sums["correct"] = jnp.sum((st["arg"] == targets_N).astype(jnp.float32) * mask_N)
    if "ids" in lse:
      sums["agreement"] = jnp.sum((st["arg"] == lse["ids"][:, 0]).astype(jnp.float32) * mask_N)
  if spec.metrics:
    sums.update(slice_metrics.sums(st["metrics"], st["arg"], mask_N))
  return jnp.sum(loss_N * mask_N), sums, lse


def _slice_logits(static, w_s, h_s, w_t, h_t, start):
  """(student, teacher or None) fp32 logits of the slice starting at `start`."""
  _, size, axes, dtype, cap, _, t_static = static
  s = slice_logits(sliced_parts(w_s, start, size, axes), h_s, axes, dtype, cap)
  if t_static is None:
    return s, None
  return s, slice_teachers.logits(t_static, w_t, h_t, start, size)


def _stats(static, w_s, h_s, w_t, h_t, targets_N):
  """Per-token statistics after one pass over every slice (for cross-entropy alone, on a TPU:
  one Pallas kernel over the whole vocabulary, vocab_stats_kernel.py)."""
  spec, size, axes, dtype, cap, columns, t_static = static
  N = h_s[0].shape[0]
  if _kernel_runs(spec, t_static is not None, N, len(w_s), cap):
    return vocab_stats_kernel.ce_stats(w_s[0], axes[0], h_s[0], dtype, targets_N, columns,
                                       spec.accuracy)
  count, starts = slices(w_s[0].shape[axes[0]], size)
  neg = jnp.full((N,), -jnp.inf, jnp.float32)
  zero = jnp.zeros((N,), jnp.float32)
  init = {"m1": neg, "l1": zero, "target": zero}
  if spec.accuracy:
    init.update(best=neg, arg=jnp.zeros((N,), jnp.int32))
  normalisers_only = spec.top_k or spec.target_term is not None
  if t_static is not None:
    init["kd"] = (slice_terms.init(spec.terms, N) if spec.terms else slice_divergences.init(
        "normalisers" if normalisers_only else spec.divergence, N))
    if spec.target_term is not None:
      init["t_target"] = zero
    if spec.top_k:
      init["top"] = slice_buckets.top_init(N, spec.top_k)
    if spec.metrics:
      init["metrics"] = slice_metrics.init(N)
  elif spec.top_k:  # the teacher's top-k given: the student's normaliser at T alone
    init["kd"] = {"mq": neg, "lq": zero}

  def body(carry, xs):
    j, start = xs
    new = new_columns(j, start, size, columns)
    s, t = _slice_logits(static, w_s, h_s, w_t, h_t, start)
    s = jnp.where(new, s, -jnp.inf)
    c = dict(carry)
    c["m1"], c["l1"] = slice_divergences.lse_step(carry["m1"], carry["l1"], s)
    cols = start + jnp.arange(size)
    hit = (cols == targets_N[:, None]) & new
    c["target"] = carry["target"] + jnp.sum(jnp.where(hit, s, 0.0), axis=-1)
    if spec.accuracy:
      best_j = jnp.max(s, axis=-1)
      arg_j = start + jnp.argmax(s, axis=-1).astype(jnp.int32)
      better = best_j > carry["best"]
      c["best"] = jnp.where(better, best_j, carry["best"])
      c["arg"] = jnp.where(better, arg_j, carry["arg"])
    if t is not None:
      t = jnp.where(new, t, -jnp.inf)
      kind = "normalisers" if normalisers_only else spec.divergence
      c["kd"] = (slice_terms.step(spec.terms, carry["kd"], s, t, new) if spec.terms else
                 slice_divergences.step(kind, carry["kd"], s, t, new, spec.temperature))
      if spec.target_term is not None:
        c["t_target"] = carry["t_target"] + jnp.sum(jnp.where(hit, t, 0.0), axis=-1)
      if spec.top_k:
        c["top"] = slice_buckets.top_step(carry["top"], t / spec.temperature, start)
      if spec.metrics:
        c["metrics"] = slice_metrics.step(carry["metrics"], s, t, new, targets_N, start)
    elif spec.top_k:
      c["kd"] = dict(zip(("mq", "lq"), slice_divergences.lse_step(
          carry["kd"]["mq"], carry["kd"]["lq"], s / spec.temperature)))
    return c, None

  return jax.lax.scan(body, init, (jnp.arange(count), starts))[0]


def _bucket_pass(static, w_s, h_s, ids_NxK, t_top_logp_NxK, lse):
  """(the top-k buckets' divergence per token, what the backward pass reads): the second pass,
  over the student's slices only, gathers its logits at the teacher's top-k ids and the rest's
  log-sum-exp."""
  spec, size, axes, dtype, cap, columns, _ = static
  count, starts = slices(w_s[0].shape[axes[0]], size)
  T = spec.temperature

  def body(carry, xs):
    j, start = xs
    s = slice_logits(sliced_parts(w_s, start, size, axes), h_s, axes, dtype, cap)
    new = new_columns(j, start, size, columns)
    return slice_buckets.gather_step(carry, s, new, ids_NxK, j, start, size, columns, T), None

  init = slice_buckets.gather_init(*ids_NxK.shape)
  got = jax.lax.scan(body, init, (jnp.arange(count), starts))[0]
  rest = got["m"] + jnp.log(got["l"])
  value, grads = slice_buckets.divergence_and_grads(
      spec.bucket_divergence, t_top_logp_NxK, got["s_top"], rest, lse["sT"], T)
  return value, {**grads, "rest": rest, "ids": ids_NxK}


def _over_slices(static, w_s, h_s, w_t, h_t, step, init):
  """A scan over every slice of both models' logits: step(carry, s, t, new) -> carry."""
  _, size, axes, _, _, columns, _ = static
  count, starts = slices(w_s[0].shape[axes[0]], size)

  def body(carry, xs):
    j, start = xs
    s, t = _slice_logits(static, w_s, h_s, w_t, h_t, start)
    return step(carry, s, t, new_columns(j, start, size, columns)), None

  return jax.lax.scan(body, init, (jnp.arange(count), starts))[0]


def _jsd_pass(static, w_s, h_s, w_t, h_t, lse):
  """(jsd, (1 - beta) KL(Q || M)) per token: the second pass over the slices."""
  spec, size, axes, _, _, columns, _ = static
  count, starts = slices(w_s[0].shape[axes[0]], size)

  def body(carry, xs):
    j, start = xs
    s, t = _slice_logits(static, w_s, h_s, w_t, h_t, start)
    terms = slice_divergences.jsd_terms(s, t, new_columns(j, start, size, columns), lse,
                                        spec.temperature, spec.beta)
    return tuple(a + b for a, b in zip(carry, terms)), None

  zero = jnp.zeros((h_s[0].shape[0],), jnp.float32)
  return jax.lax.scan(body, (zero, zero), (jnp.arange(count), starts))[0]


# ---- the backward pass: the slices again, from the saved log-sum-exps -------------------------

def _grads(static, trained, w_s, h_s, w_t, h_t, targets_N, mask_N, lse, g):
  """(d loss / d each trained weight part (None for the others), d loss / d each input part),
  in fp32, for a loss cotangent g. `trained`: which weight parts the caller differentiates."""
  spec, size, axes, dtype, cap, columns, t_static = static
  count, starts = slices(w_s[0].shape[axes[0]], size)
  scale_N = g * mask_N
  on = [i for i, t in enumerate(trained) if t]

  def body(carry, xs):
    dws, dhs = carry
    j, start = xs
    new = new_columns(j, start, size, columns)
    w_j = sliced_parts(w_s, start, size, axes)

    def logits(w_on, hs):
      operands = list(w_j)
      for i, w in zip(on, w_on):
        operands[i] = w
      return slice_logits(operands, hs, axes, dtype, cap)

    s, back = jax.vjp(logits, [w_j[i] for i in on], h_s)
    cols = start + jnp.arange(size)
    dz = spec.ce_weight * (jnp.exp(s - lse["s1"][:, None]) -
                           (cols == targets_N[:, None]).astype(jnp.float32))
    if spec.top_k:
      dz = dz + spec.kd_weight * slice_buckets.logit_grad(lse, s, lse["ids"], j, start, size,
                                                          columns, spec.temperature)
    elif spec.target_term is not None:
      dz = dz + spec.kd_weight * slice_targets.logit_grad(lse["c"], s, targets_N, start, lse,
                                                          spec.temperature)
    elif t_static is not None:
      t = slice_teachers.logits(t_static, w_t, h_t, start, size)
      dz = dz + (slice_terms.logit_grad(spec.terms, lse["terms"], s, t) if spec.terms else
                 spec.kd_weight * slice_divergences.logit_grad(spec.divergence, spec.beta, s, t,
                                                               lse, spec.temperature))
    dz = jnp.where(new, dz * scale_N[:, None], 0.0)
    dw_on, dh_j = back(dz)
    dws = [_write_slice(dw, dw_j, start, size, axes[i], new)
           for dw, dw_j, i in zip(dws, dw_on, on)]
    return (dws, [a + d.astype(jnp.float32) for a, d in zip(dhs, dh_j)]), None

  init = ([jnp.zeros(w_s[i].shape, jnp.float32) for i in on],
          [jnp.zeros(h.shape, jnp.float32) for h in h_s])
  dws, dhs = jax.lax.scan(body, init, (jnp.arange(count), starts))[0]
  full = [None] * len(w_s)
  for i, dw in zip(on, dws):
    full[i] = dw
  return full, dhs


def _write_slice(dw, dw_j, start, size, axis, new):
  """dw with the slice's new columns (the last slice's overlap kept) set from dw_j."""
  old = jax.lax.dynamic_slice_in_dim(dw, start, size, axis)
  keep = new if axis == 1 else new[:, None]
  return jax.lax.dynamic_update_slice_in_dim(
      dw, jnp.where(keep, dw_j.astype(jnp.float32), old), start, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sliced(static, w_s, h_s, w_t, h_t, top, x_N, targets_N, mask_N):
  return _forward(static, w_s, h_s, w_t, h_t, top, x_N, targets_N, mask_N)[:2]


def _sliced_fwd(static, w_s, h_s, w_t, h_t, top, x_N, targets_N, mask_N):
  # symbolic zeros: which weight parts the caller differentiates (a frozen one gets no dw)
  trained = tuple(w.perturbed for w in w_s)
  w_s, h_s, w_t, h_t, top, x_N, targets_N, mask_N = (
      custom_derivatives.custom_vjp_primal_tree_values(
          (w_s, h_s, w_t, h_t, top, x_N, targets_N, mask_N)))
  loss, sums, lse = _forward(static, w_s, h_s, w_t, h_t, top, x_N, targets_N, mask_N)
  return (loss, sums), (trained, w_s, h_s, w_t, h_t, targets_N, mask_N, lse)


def _sliced_bwd(static, res, cotangents):
  trained, w_s, h_s, w_t, h_t, targets_N, mask_N, lse = res
  g = cotangents[0]
  if isinstance(g, custom_derivatives.SymbolicZero):
    g = jnp.zeros(g.shape, g.dtype)
  dws, dhs = _grads(static, trained, w_s, h_s, w_t, h_t, targets_N, mask_N, lse, g)
  return (tuple(None if dw is None else dw.astype(w.dtype) for dw, w in zip(dws, w_s)),
          tuple(dh.astype(h.dtype) for dh, h in zip(dhs, h_s)), None, None, None, None, None,
          None)


_sliced.defvjp(_sliced_fwd, _sliced_bwd, symbolic_zeros=True)
