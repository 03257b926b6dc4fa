"""The distillation objective: one strategy (possibly a composite) as a train-step objective.

`make_distill_objective(strategy)` returns `(student, extras, batch, rng) -> ObjectiveOutput`
for `framework.step`. Inside the compiled step it runs the student and the frozen teacher
(`extras['teacher']`) on the same tokens, asking each only for the intermediates the strategy
reads (hidden states, attention probabilities), with every teacher output behind
`stop_gradient`. All token-level terms and the logit metrics share ONE pass over the logits: the
whole [B, L, V] logits, or with `chunk_size` a chunk of tokens at a time computed from the final
hidden states (chunked.py), so full fp32 logits of both models never exist at once.

Sums reported (per-token sums; the step divides them by the global token count):
  each leaf term under its name (unweighted; loss = sum of weight * term),
  LogitKD extras `{name}_divergence`,
  hard_ce, teacher_ce, top1_agreement, logit_cosine (see logit_kd.logit_metric_values).
Perplexity is exp(hard_ce mean): the trainer derives it from the reported mean.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from distillax.distill.base import DistillInputs, Strategy
from distillax.distill.logit_kd import logit_metric_values
from distillax.distill.student import unwrap_student
from distillax.errors import ConfigError
from distillax.framework import losses
from distillax.framework.step import Objective, ObjectiveOutput

TEACHER = "teacher"


def run_models(strategy: Strategy, student, extras: Mapping, batch, *, chunk_size=None,
               teacher_key: str = TEACHER) -> DistillInputs:
  """Forward passes of student and (when needed) teacher, as the strategy's DistillInputs."""
  needs = strategy.needs
  model, projections = unwrap_student(student)
  flags = dict(return_hidden_states=needs.hidden_states, return_attention=needs.attention)
  kwargs = losses.model_inputs(batch)
  tokens_BxL = batch[losses.BATCH_INPUTS]
  s_out = model(tokens_BxL, **kwargs, **flags)
  teacher, t_out = None, None
  if needs.teacher:
    if teacher_key not in extras:
      raise ConfigError(f"this distillation strategy needs an online teacher, but no frozen model "
                        f"named {teacher_key!r} was passed (extras: {sorted(extras)}); load a "
                        f"teacher or train from an offline cache with CachedLogitKD")
    teacher = extras[teacher_key]
    t_out = jax.tree.map(jax.lax.stop_gradient, teacher(tokens_BxL, **kwargs, **flags))
    vs, vt = s_out.logits_BxLxV.shape[-1], t_out.logits_BxLxV.shape[-1]
    if vs != vt:
      raise ConfigError(f"student vocabulary ({vs}) and teacher vocabulary ({vt}) differ; logit "
                        f"distillation needs one shared tokenizer")
  return DistillInputs(batch=batch, student=s_out, teacher=t_out, student_model=model,
                       teacher_model=teacher, projections=projections, chunk_size=chunk_size)


def make_distill_objective(strategy: Strategy, *, chunk_size: int | None = None,
                           teacher_key: str = TEACHER) -> Objective:
  """The step objective of `strategy`; chunk_size: tokens per logit chunk (None: unchunked)."""
  if not isinstance(strategy, Strategy):
    raise ConfigError(f"make_distill_objective needs a distillation strategy, got {strategy!r}")
  if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                 or chunk_size <= 0):
    raise ConfigError(f"distill chunk_size={chunk_size!r} must be a positive number of tokens "
                      f"or None")
  leaves = strategy.leaves()
  token_leaves = [(w, leaf) for w, leaf in leaves if leaf.needs.logits]
  other_leaves = [(w, leaf) for w, leaf in leaves if not leaf.needs.logits]

  def per_token(s_logits_NxV, t_logits_NxV, tokens):
    values = logit_metric_values(s_logits_NxV, t_logits_NxV, tokens)
    for _, leaf in token_leaves:
      values.update(leaf.token_values(s_logits_NxV, t_logits_NxV, tokens))
    return values

  def objective(student, extras, batch, rng) -> ObjectiveOutput:
    del rng
    inputs = run_models(strategy, student, extras, batch, chunk_size=chunk_size,
                        teacher_key=teacher_key)
    sums = inputs.token_sums(per_token)
    loss_sum = jnp.zeros((), jnp.float32)
    for weight, leaf in token_leaves:
      loss_sum = loss_sum + weight * sums[leaf.name]
    for weight, leaf in other_leaves:
      term, metrics = leaf.term_sums(inputs)
      loss_sum = loss_sum + weight * term
      sums.update(metrics)
    return ObjectiveOutput(loss_sum=loss_sum, tokens=jnp.sum(inputs.mask_BxL), sums=sums)

  return objective
