"""Token losses over the tokenizer's rows only (framework/token_rows.py, issue 55 point 9): with
a padded vocabulary, the next-token CE and LogitKD of both vocabulary engines (token chunks and
vocabulary slices) and of the whole-logits path equal float64 numpy over the first `rows`
columns, their gradients equal the whole logits', and the padded rows of the output layer get
no gradient; so do the eval objectives' logit metrics, a hidden-state cache's head and a
strategy with no logit term over slices. Outside a recipe's objective (no rows active) nothing
changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import partitioning as pt
from distillax.data import batch as batch_spec
from distillax.distill import (TEACHER_NLL, TOPK_IDS, TOPK_LOGPROBS, CachedLogitKD,
                               FeaturePooling, LogitKD, make_distill_objective)
from distillax.distill.teacher_head import TEACHER_HIDDEN, head_of
from distillax.framework import (losses, token_loss_impl, token_rows, vocab_chunks,
                                 vocab_slices)
from distillax.framework.step import ObjectiveOutput
from distillax.models.presets import get_preset
from distillax.trainers import lm_objective
from tests.distill.helpers import (STUDENT_CONFIG, TEACHER_CONFIG, f64, make_batch, make_models,
                                   np_log_softmax, np_logit_kd, to_jnp)
from tests.framework.test_chunked_loss import _batch
from tests.support import chip
from tests.support.models import random_model

ROWS = 200  # of the tiny preset's 256: a tokenizer's 200 ids, 56 padded rows


def _run(objective, model, extras, batch, rows):
  """(output, gradients by parameter path) of the per-token loss, traced over `rows`."""
  graphdef, state = nnx.split(model)

  def g(state):
    out = token_rows.over_token_rows(
        lambda m, e, b, r: objective(nnx.merge(graphdef, state), e, b, r), rows)(
            None, extras, batch, jax.random.key(0))
    return out.loss_sum / out.tokens, out

  (_, out), grads = jax.jit(jax.value_and_grad(g, has_aux=True))(state)
  return out, nnx.to_pure_dict(grads)


def _numpy_ce(model, batch, rows):
  """(NLL sum, argmax hits) over the masked tokens, float64 over the first `rows` logits."""
  logits = f64(model(batch[batch_spec.INPUTS], positions_BxL=batch[batch_spec.POSITIONS],
                     segment_ids_BxL=batch[batch_spec.SEGMENT_IDS]).logits_BxLxV)[..., :rows]
  y, m = np.asarray(batch[batch_spec.TARGETS]), f64(batch[batch_spec.LOSS_MASK])
  nll = -np.take_along_axis(np_log_softmax(logits), y[..., None], -1)[..., 0]
  return np.sum(nll * m), np.sum((np.argmax(logits, -1) == y) * m)


def _head_rows(grads):
  """The output layer's gradient by vocabulary row, (V, D): the untied head's (D, V)
  transposed, else the tied embedding's (no input id reaches a padded row either)."""
  if "lm_head" in grads:
    return np.asarray(grads["lm_head"]).T
  return np.asarray(grads["embedder"]["embedding"])


def _whole_ce(model, extras, batch, rng):
  """The reference: the next-token CE of the model's whole logits, the columns past the rows
  traced now masked, through jax.nn.log_softmax (autodiff's gradients)."""
  del extras, rng
  out = model(batch[batch_spec.INPUTS], **losses.model_inputs(batch))
  logits_BxLxV = token_rows.masked(out.logits_BxLxV, token_rows.active())
  loss, correct, tokens = losses.cross_entropy_sums(logits_BxLxV, batch[batch_spec.TARGETS],
                                                    batch[batch_spec.LOSS_MASK])
  return ObjectiveOutput(loss_sum=loss, tokens=tokens, sums={"accuracy": correct})


def test_lm_losses_take_their_softmax_over_the_token_rows():
  """The tiny model (256 rows) over 200 token rows: the chunk engine (13 chunks) and the
  slices (3 slices of 96 columns, the last one wholly past the tokens)
  equal numpy's CE and accuracy over the 200 columns; every gradient equals the whole logits';
  the 56 padded rows of the head get exactly zero. Without rows active, the loss is over all 256
  (numpy's other figure): what the run reported before."""
  model = random_model(get_preset("tiny").replace(num_layers=1), seed=1)
  batch = _batch(B=4, L=13, vocab=ROWS)
  want_nll, want_hits = _numpy_ce(model, batch, ROWS)
  _, grads = _run(_whole_ce, model, {}, batch, ROWS)
  assert np.all(_head_rows(grads)[ROWS:] == 0) and np.any(_head_rows(grads)[:ROWS] != 0)
  runs = []
  real = vocab_slices.slice_size_for
  try:
    vocab_slices.slice_size_for = lambda tokens, vocab, requested=0: 96
    runs.append(_run(lambda *a: lm_objective(*a, loss_impl="sliced"), model, {}, batch, ROWS))
  finally:
    vocab_slices.slice_size_for = real
  small = lambda m, e, b, r: _small_chunks(m, b)
  runs.append(_run(small, model, {}, batch, ROWS))
  for out, g in runs:
    chip.assert_close(out.loss_sum, want_nll, rtol=1e-5)
    assert float(out.sums["accuracy"]) == want_hits
    for path, w in jax.tree_util.tree_leaves_with_path(grads):
      got = g
      for key in path:
        got = got[key.key]
      chip.assert_close(got, w, atol=2e-6, err_msg=jax.tree_util.keystr(path))
  # No rows active: the softmax over every row, as before (and a different figure).
  everything, _ = _run(lm_objective, model, {}, batch, None)
  all_nll, _ = _numpy_ce(model, batch, 256)
  chip.assert_close(everything.loss_sum, all_nll, rtol=1e-5)
  assert float(everything.loss_sum) > float(want_nll) + 1.0


def _small_chunks(model, batch):
  """lm_objective's CE through the chunk engine in chunks of 4 tokens (13 chunks)."""
  from distillax.framework import losses
  from distillax.framework.step import ObjectiveOutput
  out = model(batch[batch_spec.INPUTS], **losses.model_inputs(batch), return_logits=False)
  loss, correct, tokens = losses.model_cross_entropy_sums(
      model, out.final_hidden_BxLxD, batch[batch_spec.TARGETS], batch[batch_spec.LOSS_MASK],
      chunk_size=4)
  return ObjectiveOutput(loss_sum=loss, tokens=tokens, sums={"accuracy": correct})


@pytest.fixture(scope="module")
def padded_kd():
  """LogitKD (T=2, alpha 0.7), student and teacher sharing a 48-row vocabulary of which the
  first 40 are tokens: (student, extras, batch, numpy's loss and divergence sums)."""
  student, teacher = make_models()
  rows = 40
  batch = to_jnp(make_batch(B=8, L=9, vocab=rows))
  kd = LogitKD(temperature=2.0, alpha=0.7)
  cut = lambda m: f64(m(batch["inputs_BxL"], positions_BxL=batch["positions_BxL"],
                        segment_ids_BxL=batch["segment_ids_BxL"]).logits_BxLxV)[..., :rows]
  s, t = cut(student), cut(teacher)
  V = s.shape[-1]
  loss, div = np_logit_kd(s.reshape(-1, V), t.reshape(-1, V),
                          np.asarray(batch["targets_BxL"]).reshape(-1))
  m = f64(batch["loss_mask_BxL"]).reshape(-1)
  assert STUDENT_CONFIG.vocab_size == TEACHER_CONFIG.vocab_size == 48
  return kd, rows, student, {"teacher": teacher}, batch, (np.sum(loss * m), np.sum(div * m))


@pytest.mark.parametrize("engine", ["whole", "chunked"])
def test_logit_kd_masks_the_same_rows_of_both_models(padded_kd, engine):
  """Whole logits and the chunk engine: the KD loss and its divergence equal numpy's over both
  models' first 40 columns, and the student's padded rows get no gradient (the slices equal the
  whole logits: test_the_sliced_kd_under_fsdp_equals_whole_logits)."""
  kd, rows, student, extras, batch, (want_loss, want_div) = padded_kd
  objective = make_distill_objective(kd, metrics=False, sliced=engine == "sliced",
                                     chunk_size=None if engine == "whole" else vocab_chunks.AUTO)
  out, grads = _run(objective, student, extras, batch, rows)
  chip.assert_close(out.sums["logit_kd"], want_loss, rtol=1e-5)
  chip.assert_close(out.sums["logit_kd_divergence"], want_div, rtol=1e-5)
  assert np.all(_head_rows(grads)[rows:] == 0) and np.any(_head_rows(grads)[:rows] != 0)


def test_the_sliced_kd_under_fsdp_equals_whole_logits(padded_kd):
  """Masked, under fsdp on 8 devices, a jsd of beta 0.3 over the teacher's top 8 and a rest
  bucket (the slices' second pass): the slices (what ran: vocabulary slices) equal the
  whole-logits objective on one device (log_softmax, jax.lax.top_k and autodiff), loss, the
  logit_kd / logit_kd_divergence / hard_ce sums and every gradient."""
  _, rows, student, extras, batch, _ = padded_kd
  kd = LogitKD(temperature=2.0, alpha=0.7, divergence="jsd", beta=0.3, top_k=8)
  whole = make_distill_objective(kd, metrics=False, chunk_size=None)
  want_out, want = _run(whole, student, extras, batch, rows)
  mesh = pt.create_mesh({"data": 8, "model": 1})
  with pt.use_rules(mesh, pt.rules_from_config({"strategy": "fsdp"})), \
       token_loss_impl.recorded_choices() as ran:
    out, got = _run(make_distill_objective(kd, metrics=False, sliced=True), student, extras,
                    batch, rows)
  _assert_sliced_equals_whole(ran, out, got, want_out, want)
  assert np.all(_head_rows(got)[rows:] == 0) and np.any(_head_rows(got)[:rows] != 0)


def test_a_cached_top_k_kd_over_slices_equals_whole_logits(padded_kd):
  """A top-k cache (the teacher's top 8 log-probs at T over its 40 token columns, its NLL) read
  by CachedLogitKD (reverse KL), with the metrics a cached train step reports: over vocabulary
  slices the loss, the logit_kd / logit_kd_divergence / hard_ce / teacher_ce / top1_agreement
  sums and every gradient equal the whole-logits objective's."""
  _, rows, student, extras, batch, _ = padded_kd
  t = extras["teacher"](batch["inputs_BxL"], positions_BxL=batch["positions_BxL"],
                        segment_ids_BxL=batch["segment_ids_BxL"]).logits_BxLxV[..., :rows]
  top_logp, ids = jax.lax.top_k(jax.nn.log_softmax(t / 2.0, -1), 8)
  nll = -jnp.take_along_axis(jax.nn.log_softmax(t, -1), batch["targets_BxL"][..., None], -1)
  cached = {**batch, TOPK_IDS: ids, TOPK_LOGPROBS: top_logp, TEACHER_NLL: nll[..., 0]}
  kd = CachedLogitKD(temperature=2.0, alpha=0.7, divergence="reverse_kl")
  want_out, want = _run(make_distill_objective(kd, chunk_size=None), student, {}, cached, rows)
  with token_loss_impl.recorded_choices() as ran:
    out, got = _run(make_distill_objective(kd, sliced=True), student, {}, cached, rows)
  _assert_sliced_equals_whole(ran, out, got, want_out, want)


@pytest.mark.parametrize("engine", ["chunked", "sliced"])
def test_logit_metrics_read_the_token_columns_alone(padded_kd, engine):
  """The eval objective's logit metrics over both models' first 40 columns, through either
  engine: teacher_ce, top1_agreement and logit_cosine equal numpy's there (the cosine read the
  masked columns as raw logits, a square of -1e30: NaN in the demo's eval)."""
  kd, rows, student, extras, batch, _ = padded_kd
  objective = make_distill_objective(kd, metrics=True, sliced=engine == "sliced")
  with token_loss_impl.recorded_choices() as ran:
    out, _ = _run(objective, student, extras, batch, rows)
  assert [k.split(" (")[0] for k in ran] == [engine]
  forward = lambda m: f64(m(batch["inputs_BxL"], positions_BxL=batch["positions_BxL"],
                            segment_ids_BxL=batch["segment_ids_BxL"]).logits_BxLxV)[..., :rows]
  s, t = forward(student), forward(extras["teacher"])
  m, y = f64(batch["loss_mask_BxL"]), np.asarray(batch["targets_BxL"])
  teacher_nll = -np.take_along_axis(np_log_softmax(t), y[..., None], -1)[..., 0]
  cosine = np.sum(s * t, -1) / (np.linalg.norm(s, axis=-1) * np.linalg.norm(t, axis=-1))
  chip.assert_close(out.sums["teacher_ce"], np.sum(teacher_nll * m), rtol=1e-5)
  chip.assert_close(out.sums["logit_cosine"], np.sum(cosine * m), rtol=1e-5)
  assert float(out.sums["top1_agreement"]) == np.sum((s.argmax(-1) == t.argmax(-1)) * m)


@pytest.mark.parametrize("kd", [
    LogitKD(temperature=2.0, alpha=0.7),
    LogitKD(temperature=1.5, alpha=0.4, divergence="reverse_kl", top_k=8),
], ids=["forward_kl", "reverse_kl_top8"])
def test_the_sliced_eval_objective_equals_whole_logits(padded_kd, kd):
  """An eval objective (metrics=True) over vocabulary slices, whose teacher_ce, top1_agreement
  and logit_cosine ride the slices (framework/slice_metrics.py): its loss, every sum and every
  gradient equal the whole-logits objective's over the 40 token columns."""
  _, rows, student, extras, batch, _ = padded_kd
  want_out, want = _run(make_distill_objective(kd, chunk_size=None), student, extras, batch,
                        rows)
  with token_loss_impl.recorded_choices() as ran:
    out, got = _run(make_distill_objective(kd, sliced=True), student, extras, batch, rows)
  assert {"teacher_ce", "top1_agreement", "logit_cosine"} <= set(out.sums)
  _assert_sliced_equals_whole(ran, out, got, want_out, want)


def test_a_hidden_cache_heads_kd_over_slices_equals_whole_logits(padded_kd):
  """A hidden-state cache's teacher (its TeacherHead and the batch's cached final hidden
  states) read over vocabulary slices through the head's output_operands: train and eval
  objectives equal the whole-logits ones, loss, sums and every gradient."""
  _, rows, student, extras, batch, _ = padded_kd
  teacher = extras["teacher"]
  hidden = teacher(batch["inputs_BxL"], positions_BxL=batch["positions_BxL"],
                   segment_ids_BxL=batch["segment_ids_BxL"], return_logits=False)
  cached = {**batch, TEACHER_HIDDEN: hidden.final_hidden_BxLxD}
  head = {"teacher": head_of(teacher)}
  kd = LogitKD(temperature=2.0, alpha=0.7, divergence="jsd", beta=0.3)
  for metrics in (False, True):
    want_out, want = _run(make_distill_objective(kd, chunk_size=None, metrics=metrics),
                          student, head, cached, rows)
    with token_loss_impl.recorded_choices() as ran:
      out, got = _run(make_distill_objective(kd, sliced=True, metrics=metrics), student, head,
                      cached, rows)
    _assert_sliced_equals_whole(ran, out, got, want_out, want)


@pytest.mark.parametrize("metrics", [False, True])
def test_a_strategy_with_no_logit_term_reports_its_metrics_over_slices(padded_kd, metrics):
  """Feature distillation alone: the hard_ce it reports (and an eval's teacher_ce,
  top1_agreement and logit_cosine) over vocabulary slices equal the whole logits' over the 40
  token columns, and the loss and every gradient are the feature term's alone."""
  _, rows, student, extras, batch, _ = padded_kd
  features = FeaturePooling([(2, 3)])
  want_out, want = _run(make_distill_objective(features, chunk_size=None, metrics=metrics),
                        student, extras, batch, rows)
  with token_loss_impl.recorded_choices() as ran:
    out, got = _run(make_distill_objective(features, sliced=True, metrics=metrics), student,
                    extras, batch, rows)
  assert ("teacher_ce" in out.sums) == metrics and "hard_ce" in out.sums
  _assert_sliced_equals_whole(ran, out, got, want_out, want)


def _assert_sliced_equals_whole(ran, out, got, want_out, want):
  """The objective ran over vocabulary slices, and its loss, sums and every gradient equal the
  whole-logits objective's."""
  assert [k.split(" (")[0] for k in ran] == ["sliced"]
  chip.assert_close(out.loss_sum, want_out.loss_sum, rtol=1e-5)
  assert sorted(out.sums) == sorted(want_out.sums)
  for k in out.sums:
    chip.assert_close(out.sums[k], want_out.sums[k], rtol=1e-5, err_msg=k)
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    chip.assert_close(g, w, atol=1e-5, err_msg=jax.tree_util.keystr(path))
