"""The distillation objective: one strategy (possibly a composite) as a train-step objective.

`make_distill_objective(strategy)` returns `(student, extras, batch, rng) -> ObjectiveOutput`
for `framework.step`. Inside the compiled step it runs the student and the frozen teacher
(`extras['teacher']`) on the same tokens, asking each only for the intermediates the strategy
reads (hidden states, attention probabilities), with every teacher output behind
`stop_gradient`. The teacher may be a hidden-state cache's TeacherHead (teacher_head.py): its
output is then the batch's cached final hidden states, and its logits the head's, so every
logit strategy reads them as a live teacher's. All token-level terms and the logit metrics share ONE pass over the logits: the
whole [B, L, V] logits (chunk_size None), or a chunk of tokens at a time computed from the final
hidden states (framework/vocab_chunks.py; the default, AUTO, sizes chunks per device), so
full fp32 logits of either model never exist at once. Within that pass every reduction over the
vocabulary is made once per model and temperature and shared (logits.TokenLogits).

Sums reported (per-token sums; the step divides them by the global token count):
  each leaf term under its name (unweighted; loss = sum of weight * term),
  LogitKD extras `{name}_divergence`,
  hard_ce, and with metrics=True (eval objectives) teacher_ce, top1_agreement, logit_cosine
  (see logit_kd.logit_metric_values): they cost passes over the vocabulary no loss needs, so
  train objectives (metrics=False) leave them out.
Perplexity is exp(hard_ce mean): the trainer derives it from the reported mean.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from distillax.data import batch as batch_spec
from distillax.framework import vocab_chunks
from distillax.distill import tpu_chunks
from distillax.distill.base import DistillInputs, Strategy
from distillax.distill.logit_kd import (shared_metric_values, sliced_leaves,
                                        sliced_loss_and_sums, sliced_metric_sums)
from distillax.distill.logits import TokenLogits
from distillax.distill.multi_teacher import TeacherMix, TeacherSet, teacher_set
from distillax.distill.student import unwrap_student
from distillax.distill.teacher_head import TEACHER_HIDDEN, TeacherHead
from distillax.errors import ConfigError
from distillax.framework import losses
from distillax.framework.step import Objective, ObjectiveOutput
from distillax.models.moe import layer as moe

TEACHER = "teacher"


def run_models(strategy: Strategy, student, extras: Mapping, batch, *, chunk_size=None,
               teacher_key: str = TEACHER) -> DistillInputs:
  """Forward passes of student and (when needed) teacher, as the strategy's DistillInputs.

  chunk_size: None (the forward passes return full logits), vocab_chunks.AUTO or tokens per chunk
  (they return final hidden states only: the logits are made chunk by chunk)."""
  needs = strategy.needs
  model, projections = unwrap_student(student)
  teacher = _teacher(extras, teacher_key) if needs.teacher else None
  if teacher is not None:  # a teacher table padded past the student's is cut (base.py)
    vs, vt = model.config.vocab_size, teacher.config.vocab_size
    if vs > vt:
      raise ConfigError(f"student vocabulary ({vs}) is wider than the teacher's ({vt}); logit "
                        f"distillation needs one shared tokenizer (a teacher table may only be "
                        f"padded past the student's), or a cross-tokenizer objective "
                        f"(--config.distill.objective=cross_tokenizer)")
  tokens_BxL = batch[batch_spec.INPUTS]
  vocab_chunks.check_chunk_size(chunk_size)
  flags = dict(return_hidden_states=needs.hidden_states, return_attention=needs.attention)
  if needs.router_logits:
    flags["return_router_logits"] = True
  if chunk_size is not None:
    flags["return_logits"] = False
  kwargs = losses.model_inputs(batch)
  s_out = model(tokens_BxL, **kwargs, **flags)
  t_out = None
  if isinstance(teacher, TeacherHead):  # a hidden-state cache: its states come with the batch
    t_out = jax.tree.map(jax.lax.stop_gradient, _cached_teacher(teacher, batch, needs, flags))
  elif isinstance(teacher, TeacherSet):  # several; one may be a cache, whose states come along
    t_out = jax.tree.map(jax.lax.stop_gradient, teacher(
        tokens_BxL, cached_hidden_BxLxD=batch.get(TEACHER_HIDDEN), **kwargs, **flags))
  elif teacher is not None:
    t_out = jax.tree.map(jax.lax.stop_gradient, teacher(tokens_BxL, **kwargs, **flags))
  return DistillInputs(batch=batch, student=s_out, teacher=t_out, student_model=model,
                       teacher_model=teacher, projections=projections, chunk_size=chunk_size)


def _cached_teacher(head: TeacherHead, batch, needs, flags):
  """The teacher's output from a hidden-state cache: its logits are the head's."""
  if needs.hidden_states or needs.attention or needs.router_logits:
    raise ConfigError("a hidden-state teacher cache holds the final hidden states only; "
                      "attention, feature and router distillation need the teacher in memory: "
                      "set their distill.*.weight to 0 or clear teacher.cache_dir")
  if TEACHER_HIDDEN not in batch:
    raise ConfigError(f"the teacher is a hidden-state cache's head, but the batch has no "
                      f"{TEACHER_HIDDEN}; feed batches from read_teacher_cache")
  return head.output(batch[TEACHER_HIDDEN], return_logits=flags.get("return_logits", True))


def _teacher(extras: Mapping, teacher_key: str):
  if teacher_key not in extras:
    raise ConfigError(f"this distillation strategy needs an online teacher, but no frozen model "
                      f"named {teacher_key!r} was passed (extras: {sorted(extras)}); load a "
                      f"teacher or train from an offline cache with CachedLogitKD")
  return extras[teacher_key]


def make_distill_objective(strategy: Strategy, *, chunk_size: int | None = vocab_chunks.AUTO,
                           teacher_key: str = TEACHER, metrics: bool = True,
                           router_loss_weights: tuple[float, float] = (0.0, 0.0),
                           teachers: TeacherMix | None = None, sliced: bool = False,
                           chunks_on_tpu: bool = False) -> Objective:
  """The step objective of `strategy`.

  chunk_size: tokens per logit chunk; vocab_chunks.AUTO (default) picks it from the vocabulary and
    the batch per device (vocab_chunks.auto_chunk_len); None: unchunked full logits.
  metrics: also report teacher_ce, top1_agreement and logit_cosine (eval objectives: passes over
    the vocabulary no loss needs); False: the loss terms and hard_ce only (train objectives).
  router_loss_weights: (Switch load-balancing, router z-loss) weights for a mixture-of-experts
    student, whose router losses and expert loads are reported whatever the weights.
  teachers: several teachers (multi_teacher.py), passed as extras under `teachers.keys` and
    folded into one teacher per token (mixture or routing); logit strategies only.
  sliced: the logit terms over vocabulary slices (framework/vocab_slices.py; train.loss_impl
    'sliced'): one LogitKD or several, from one teacher or several, or none, with their
    metrics (logit_kd.sliced_leaves says what it refuses).
  chunks_on_tpu: train.loss_impl='auto': a live teacher's LogitKDs in a train objective take
    the chunk engine at large chunks where the step compiles for a TPU (tpu_chunks.py).
  """
  if not isinstance(strategy, Strategy):
    raise ConfigError(f"make_distill_objective needs a distillation strategy, got {strategy!r}")
  vocab_chunks.check_chunk_size(chunk_size)
  leaves = strategy.leaves()
  token_leaves = [(w, leaf) for w, leaf in leaves if leaf.needs.logits]
  other_leaves = [(w, leaf) for w, leaf in leaves if not leaf.needs.logits]
  weights = {leaf.name: w for w, leaf in token_leaves}
  sliced_terms = sliced_leaves(token_leaves, teachers) if sliced else None
  if sliced and chunk_size is None:
    chunk_size = vocab_chunks.AUTO  # the forward passes return hidden states, not logits
  if teachers is not None and other_leaves:
    raise ConfigError(f"several teachers combine their logits only; "
                      f"{', '.join(leaf.name for _, leaf in other_leaves)} need one teacher's "
                      f"layers: set their distill.*.weight to 0")

  per_token = _token_values(token_leaves, teachers, metrics)
  chunks_on_tpu &= sliced_terms is not None and tpu_chunks.may_take_chunks(token_leaves, teachers,
                                                                          train=not metrics)

  def objective(student, extras, batch, rng) -> ObjectiveOutput:
    del rng
    if teachers is not None:
      vocab = unwrap_student(student)[0].config.vocab_size
      extras = {**extras, teacher_key: teacher_set(extras, teachers, vocab)}
    inputs = run_models(strategy, student, extras, batch, chunk_size=chunk_size,
                        teacher_key=teacher_key)
    chunked = tpu_chunks.over_chunks(inputs) if chunks_on_tpu else None
    if chunked is not None:
      loss_sum, sums = chunked.loss_and_sums(per_token, weights)
    elif sliced_terms is not None:
      loss_sum, sums = sliced_loss_and_sums(sliced_terms, inputs, metrics=metrics,
                                            teachers=teachers)
    elif sliced:  # no logit term: the metrics alone
      loss_sum, sums = sliced_metric_sums(inputs, metrics, teachers)
    else:
      loss_sum, sums = inputs.loss_and_sums(per_token, weights)
    return _with_other_terms(inputs, loss_sum, sums, other_leaves, router_loss_weights)

  return objective


def _token_values(token_leaves, teachers: TeacherMix | None, metrics: bool):
  """The token function of the logit terms: one pass over the logits shared by every leaf."""
  def per_token(s_logits_NxV, t_logits_NxV, tokens):
    if teachers is not None and t_logits_NxV is not None:
      t_logits_NxV = teachers.combine(t_logits_NxV, tokens)
    logits = TokenLogits(s_logits_NxV, t_logits_NxV, tokens)
    values = shared_metric_values(logits, extra=metrics)
    for _, leaf in token_leaves:
      values.update(leaf.shared_token_values(logits))
    return values
  return per_token


def _with_other_terms(inputs: DistillInputs, loss_sum, sums, other_leaves,
                      router_loss_weights) -> ObjectiveOutput:
  """The logit terms' (loss, sums) with the terms that read layers (attention, features) and an
  MoE student's router losses added."""
  for weight, leaf in other_leaves:
    term, metrics_of_leaf = leaf.term_sums(inputs)
    loss_sum = loss_sum + weight * term
    sums.update(metrics_of_leaf)
  tokens, ratios = jnp.sum(inputs.mask_BxL), {}
  if inputs.student.router_stats is not None:
    extra, router_sums, ratios = moe.objective_terms(inputs.student.router_stats, tokens,
                                                     *router_loss_weights)
    loss_sum = loss_sum + extra
    sums.update(router_sums)
  return ObjectiveOutput(loss_sum=loss_sum, tokens=tokens, sums=sums, ratios=ratios)
