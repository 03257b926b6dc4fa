"""The cross-tokenizer terms (losses.py) over the vocabulary-chunk engine: neither
model's [tokens, V] logits are held whole, only a chunk of positions at a time.

The engine sums per-position values over one pass of the student's positions, with the
teacher's logits at the same positions. The three terms read each group's first position on
both sides (exact KL, ULD), and sums of target log-probabilities over the group's positions
(GOLD's span probability, ULD's merge factor), nonlinearly. So the loss is built in passes:

  A  target log-probabilities of every position, both models, chunk by chunk, no gradient:
     each group's span log-probability and merge factor (span - the first target's);
  B  at each span group's first positions on both sides (both models' hidden states gathered
     there, span groups only: span_groups.over_selected): ULD, differentiable in the student's
     hidden states and output layer, and d ULD / d (the student's merge factor), no gradient;
  C  the engine over the student's positions, the teacher's hidden states gathered to the
     student position that starts each group: exact KL at first positions, the hard CE, and one
     linear term sum_p w_p * (lp_p - stop_gradient(lp_p)) over the target log-probabilities,
     whose weight w_p is d(span KL + ULD)/d lp_p from A and B. It is zero, and its gradient is
     exactly the span terms' gradient through the positions' log-probabilities.

The span KL's value comes from A (it has no gradient path of its own). So the loss value and
its gradient equal the whole-logit objective's, with the student's and teacher's logits made
twice (A, C) plus once more at the span groups' first positions (B): memory for time.

ULD sorts each span group's merged distribution over the larger vocabulary, a chunk of span
groups at a time, [rows, slots, V]. It needs the whole sorted vector of each row (the distance
pairs the k-th largest of one side with the k-th largest of the other, for every k), so a row is
never split across the vocabulary. Only span groups are sorted: sorting every position and
masking the others was ~90% of a cross-tokenizer on-policy step on the CPU
(benchmarks/cross_tokenizer_on_policy.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from distillax.data.cross_tokenizer.alignment import EXACT, SPAN
from distillax.distill.cross_tokenizer import span_groups
from distillax.distill.cross_tokenizer.losses import AlignedTargets, bernoulli_kl, shared_kl
from distillax.distill.cross_tokenizer.uld import uld_and_scale_grad
from distillax.framework import losses, vocab_chunks
from distillax.framework.vocab_chunks import OutputLayer


def _chunked_rows(fn, n: int, *xs_BxL):
  """fn over chunk j = positions j, j + n, ... of every (B, L, ...) input (the engine's
  layout), results put back to (B, L, ...)."""
  B, L = xs_BxL[0].shape[:2]
  C = math.ceil(L / n)

  def to_chunks(x):
    x = jnp.pad(x, [(0, 0), (0, n * C - L)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, C, n, *x.shape[2:]), 2, 0)

  out_nxBxC = jax.lax.map(lambda xs: fn(*xs), tuple(to_chunks(x) for x in xs_BxL))
  return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 2).reshape(B, n * C, *y.shape[3:])[:, :L],
                      out_nxBxC)


def _num_chunks(chunk_size, layer: OutputLayer, hidden_BxLxD) -> int:
  B, L = hidden_BxLxD.shape[:2]
  vocab = jax.eval_shape(layer.logits_fn, layer.params, hidden_BxLxD[:, :1]).shape[-1]
  return math.ceil(L / vocab_chunks.chunk_len(chunk_size, B, L, vocab))


def _logp(layer: OutputLayer, h_BxCxD, T: float):
  B, C, D = h_BxCxD.shape
  logits_NxV = layer.logits_fn(layer.params, h_BxCxD.reshape(B * C, D)).astype(jnp.float32)
  return jax.nn.log_softmax(logits_NxV / T, -1).reshape(B, C, -1)


def target_logprobs(layer: OutputLayer, hidden_BxLxD, targets_BxL, T: float, chunk_size):
  """log softmax(logits / T)[target] per position (B, L), chunk by chunk, no gradient."""
  layer = OutputLayer(layer.logits_fn, jax.lax.stop_gradient(layer.params))
  n = _num_chunks(chunk_size, layer, hidden_BxLxD)

  def one(h_BxCxD, t_BxC):
    logp = _logp(layer, h_BxCxD, T)
    return jnp.take_along_axis(logp, t_BxC[..., None], -1)[..., 0]
  return _chunked_rows(one, n, jax.lax.stop_gradient(hidden_BxLxD), targets_BxL)


def _group_stats(group_BxL, target_logp_BxL, G: int):
  """(span log-prob [B, G], first position [B, G] (0 when empty), its target log-prob)."""
  B, L = group_BxL.shape
  seg_BxL = jnp.where(group_BxL >= 0, group_BxL, G)
  span = jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, G + 1))(target_logp_BxL, seg_BxL)
  first = jax.vmap(lambda s: jax.ops.segment_min(jnp.arange(L), s, G + 1))(seg_BxL)
  first = jnp.clip(first[:, :G], 0, L - 1)
  return span[:, :G], first, jnp.take_along_axis(target_logp_BxL, first, 1)


def _gather(x_BxLx, index_BxK):
  """x[b, index[b, k]] (B, K, ...)."""
  index = index_BxK.reshape(index_BxK.shape + (1,) * (x_BxLx.ndim - 2))
  return jnp.take_along_axis(x_BxLx, index, 1)


def _values_fn(T: float, student_ids_S, teacher_ids_S):
  """Pass C's per-position values (see the module doc)."""

  def values_fn(s_NxV, t_NxV, tok):
    logp_s = jax.nn.log_softmax(s_NxV.astype(jnp.float32) / T, -1)
    logp_t = jax.nn.log_softmax(t_NxV.astype(jnp.float32) / T, -1)
    lp = jnp.take_along_axis(logp_s, tok["targets"][:, None], -1)[:, 0]
    kl = shared_kl(logp_t, logp_s, teacher_ids_S, student_ids_S)
    return {"exact_kl": jnp.where(tok["first_exact"], kl, 0.0),
            "hard_ce": losses.token_nll(s_NxV, tok["targets"]) * tok["loss_mask"],
            "span_grad": tok["weight"] * (lp - jax.lax.stop_gradient(lp))}

  return values_fn


def chunked_terms(student: OutputLayer, student_hidden_BxLxD, teacher: OutputLayer,
                  teacher_hidden_BxMxD, aligned: AlignedTargets, loss_mask_BxL, student_ids_S,
                  teacher_ids_S, *, temperature: float, weights: dict[str, float], chunk_size):
  """(loss, sums) of the cross-tokenizer objective: loss = weights['exact_kl'] * exact_kl +
  weights['span_kl'] * span_kl + weights['uld'] * uld + weights['hard_ce'] * hard CE (T = 1,
  over `loss_mask_BxL`); sums: each term's sum (metrics). See the module doc."""
  T = float(temperature)
  (s_targets, t_targets, s_group, t_group, kind_BxG) = aligned
  G = kind_BxG.shape[1]
  teacher_hidden_BxMxD = jax.lax.stop_gradient(teacher_hidden_BxMxD)
  # A: each group's span log-probability and merge factor on both sides.
  s_lp = target_logprobs(student, student_hidden_BxLxD, s_targets, T, chunk_size)
  t_lp = target_logprobs(teacher, teacher_hidden_BxMxD, t_targets, T, chunk_size)
  span_s, first_s, first_lp_s = _group_stats(s_group, s_lp, G)
  span_t, first_t, first_lp_t = _group_stats(t_group, t_lp, G)
  exact, span = kind_BxG == EXACT, kind_BxG == SPAN
  shift_s = jnp.where(span, span_s - first_lp_s, 0.0)
  shift_t = jnp.where(span, span_t - first_lp_t, 0.0)
  span_kl_BxG = jnp.where(span, bernoulli_kl(span_t, span_s), 0.0)
  d_span_BxG = jnp.where(span, jax.vmap(jax.vmap(jax.grad(bernoulli_kl, 1)))(span_t, span_s), 0.)
  # B: ULD at each span group's first positions (differentiable), d ULD / d shift_s.
  uld = _span_uld(student, (student_hidden_BxLxD, first_s), teacher,
                  (teacher_hidden_BxMxD, first_t), jax.lax.stop_gradient(shift_s), shift_t,
                  span, T, chunk_size)
  d_uld_BxG = uld["d_shift"]
  # C: the engine over the student's positions.
  B, L = s_group.shape
  g_BxL = jnp.maximum(s_group, 0)
  at = lambda x_BxG: jnp.take_along_axis(x_BxG, g_BxL, 1)
  is_first = (s_group >= 0) & (at(first_s) == jnp.arange(L)[None])
  kind_BxL = jnp.where(s_group >= 0, at(kind_BxG), -1)
  weight_BxL = jnp.where(s_group >= 0, weights["span_kl"] * at(d_span_BxG)
                         + weights["uld"] * jnp.where(is_first, 0.0, at(d_uld_BxG)), 0.0)
  teacher_at_BxL = jnp.where(is_first, at(first_t), 0)
  tokens = {"targets": s_targets, "loss_mask": loss_mask_BxL.astype(jnp.float32),
            "first_exact": is_first & (kind_BxL == EXACT), "weight": weight_BxL}

  engine_weights = {"exact_kl": weights["exact_kl"], "hard_ce": weights["hard_ce"],
                    "span_grad": 1.0}
  mask_BxL = ((s_group >= 0) | (loss_mask_BxL > 0)).astype(jnp.float32)
  loss, sums = vocab_chunks.vocab_chunk_sums(
      _values_fn(T, student_ids_S, teacher_ids_S), engine_weights, tokens, mask_BxL, student,
      student_hidden_BxLxD, teacher, _gather(teacher_hidden_BxMxD, teacher_at_BxL),
      chunk_size=chunk_size)
  span_kl = jax.lax.stop_gradient(jnp.sum(span_kl_BxG))
  uld_sum = jnp.sum(uld["uld"])
  sums = {"exact_kl": sums["exact_kl"], "span_kl": span_kl,
          "uld": jax.lax.stop_gradient(uld_sum), "hard_ce": sums["hard_ce"]}
  return loss + weights["span_kl"] * span_kl + weights["uld"] * uld_sum, sums


def _span_uld(student: OutputLayer, student_at, teacher: OutputLayer, teacher_at, shift_s_BxG,
              shift_t_BxG, span_BxG, T: float, chunk_size):
  """{'uld': [B, G] ULD of each span group (differentiable in the student), 'd_shift': d ULD /
  d shift_s (no gradient)}, 0 at other groups. student_at / teacher_at: (hidden, each group's
  first position). Only span groups are computed (span_groups.over_selected); both come from
  one pair of sorts (uld.uld_and_scale_grad)."""
  t_layer = OutputLayer(teacher.logits_fn, jax.lax.stop_gradient(teacher.params))
  (s_hidden, first_s_BxG), (t_hidden, first_t_BxG) = student_at, teacher_at
  t_hidden = jax.lax.stop_gradient(t_hidden)
  B, G = span_BxG.shape
  vocab = max(jax.eval_shape(layer.logits_fn, layer.params, h[:, :1]).shape[-1]
              for layer, h in ((student, s_hidden), (t_layer, t_hidden)))

  def one(index_BxR):
    at = lambda x_BxG: jnp.take_along_axis(x_BxG, index_BxR, 1)
    merged_s = jnp.exp(_logp(student, _gather(s_hidden, at(first_s_BxG)), T)
                       + at(shift_s_BxG)[..., None])
    merged_t = jnp.exp(_logp(t_layer, _gather(t_hidden, at(first_t_BxG)), T)
                       + at(shift_t_BxG)[..., None])
    uld, d_shift = uld_and_scale_grad(merged_s, merged_t)
    return {"uld": uld, "d_shift": jax.lax.stop_gradient(d_shift)}

  return span_groups.over_selected(one, span_BxG,
                                   vocab_chunks.chunk_len(chunk_size, B, G, vocab))
