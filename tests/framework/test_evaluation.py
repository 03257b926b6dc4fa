"""framework.evaluation.evaluate, the one evaluation route: exact token-weighted means over every
eval batch and, on request, the student's per-token values, against numpy on the same model's
logits."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from distillax.errors import UserError
from distillax.framework import evaluation, losses
from distillax.framework.step import ObjectiveOutput
from distillax.models.init import create_model
from distillax.trainers import lm_objective
from tests.support.engines import mesh_and_rules, packed_batches, tiny_engine
from tests.support.models import TINY


def _numpy_nll(model, batch):
  """Per-token next-token NLL from the model's own forward, in float64 numpy."""
  out = model(batch["inputs_BxL"], **losses.model_inputs(batch))
  logits = np.asarray(out.logits_BxLxV, np.float64)
  logits -= logits.max(-1, keepdims=True)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return -np.take_along_axis(log_probs, batch["targets_BxL"][..., None], -1)[..., 0]


def _uneven_eval():
  """(model, engine, batches): three batches with very different numbers of real tokens."""
  mesh, rules = mesh_and_rules("fsdp_tp", 4, 2)
  model = create_model(TINY, mesh=mesh, rules=rules, seed=3)
  batches = packed_batches(3, seed=5)
  for batch, keep in zip(batches, (1.0, 0.5, 0.1)):
    rows = int(len(batch["loss_mask_BxL"]) * keep) or 1
    batch["loss_mask_BxL"][rows:] = 0.0
  engine = tiny_engine(model, batches[0], mesh, rules, compile_now=False)  # no train step runs
  return model, engine, batches


def test_eval_weights_every_real_token_alike():
  """The eval loss is the mean over all the batches' real tokens, not the mean of per-batch
  means."""
  model, engine, batches = _uneven_eval()
  got = evaluation.evaluate(engine, engine.init_state(model, {}, seed=0), batches)

  nll = np.concatenate([_numpy_nll(model, b)[b["loss_mask_BxL"] > 0] for b in batches])
  assert got["eval_tokens"] == nll.size
  assert got["eval_loss"] == pytest.approx(nll.mean(), rel=1e-5)
  assert got["eval_perplexity"] == pytest.approx(math.exp(nll.mean()), rel=1e-5)
  per_batch_means = [_numpy_nll(model, b)[b["loss_mask_BxL"] > 0].mean() for b in batches]
  # The tolerance above is tight enough to tell the two apart (a random model's losses differ
  # little between batches, so the gap is small but several tolerances wide).
  assert abs(np.mean(per_batch_means) - nll.mean()) > 5 * 1e-5 * nll.mean()


def test_per_token_values_are_the_students_and_leave_the_means_unchanged():
  """per_token=True: each batch's -log p(target) and top-1 token at every position, as numpy
  computes them from the model's logits; the means are the ones without it, to the last digit
  (the sums run in the same compiled function)."""
  model, engine, batches = _uneven_eval()
  state = engine.init_state(model, {}, seed=0)
  means, tokens = evaluation.evaluate(engine, state, batches, per_token=True)
  assert means == evaluation.evaluate(engine, state, batches)
  assert len(tokens.nll_BxL) == len(tokens.top1_BxL) == len(batches)
  for batch, nll_BxL, top1_BxL in zip(batches, tokens.nll_BxL, tokens.top1_BxL):
    assert nll_BxL.shape == top1_BxL.shape == batch["targets_BxL"].shape
    np.testing.assert_allclose(nll_BxL, _numpy_nll(model, batch), rtol=1e-5, atol=1e-6)
    logits = np.asarray(model(batch["inputs_BxL"], **losses.model_inputs(batch)).logits_BxLxV)
    np.testing.assert_array_equal(top1_BxL, logits.argmax(-1))
  # Their masked sum is the eval loss's sum (float32 on the device vs float64 here).
  total = sum(float(np.sum(n.astype(np.float64) * b["loss_mask_BxL"]))
              for n, b in zip(tokens.nll_BxL, batches))
  assert total / means["eval_tokens"] == pytest.approx(means["eval_loss"], rel=1e-6)


def _objective_with_a_term_besides_ce(student, extras, batch, rng):
  """A distillation-like objective: its loss is 3 x the next-token CE + 1 per token, and it
  reports the CE as hard_ce, as every distillation objective does."""
  out = lm_objective(student, extras, batch, rng)
  return ObjectiveOutput(loss_sum=3.0 * out.loss_sum + out.tokens, tokens=out.tokens,
                         sums={"hard_ce": out.loss_sum})


def test_eval_loss_is_the_next_token_ce_and_eval_objective_the_objective():
  """In a distillation run eval_loss used to be the objective (1.548) next to the perplexity of
  the CE (161): the names now say which figure is which, whatever the objective."""
  model, lm_engine, batches = _uneven_eval()
  engine = dataclasses.replace(lm_engine, objective=_objective_with_a_term_besides_ce, evals={})
  got = evaluation.evaluate(engine, engine.init_state(model, {}, seed=0), batches)
  nll = np.concatenate([_numpy_nll(model, b)[b["loss_mask_BxL"] > 0] for b in batches])
  assert got["eval_loss"] == pytest.approx(nll.mean(), rel=1e-5)
  assert got["eval_perplexity"] == pytest.approx(math.exp(nll.mean()), rel=1e-5)
  assert got["eval_objective"] == pytest.approx(3 * nll.mean() + 1, rel=1e-5)
  # Next-token training: the objective is the CE.
  plain = evaluation.evaluate(lm_engine, lm_engine.init_state(model, {}, seed=0), batches)
  assert plain["eval_objective"] == plain["eval_loss"]


def _objective_with_a_ratio(student, extras, batch, rng):
  """The LM objective reporting the first row's share of the kept tokens, as a ratio of sums
  (a mixture of experts reports its expert loads so)."""
  out = lm_objective(student, extras, batch, rng)
  first_row = jnp.sum(batch["loss_mask_BxL"][0] > 0).astype(jnp.float32)
  return ObjectiveOutput(loss_sum=out.loss_sum, tokens=out.tokens, sums=out.sums,
                         ratios={"first_row_share": (first_row, out.tokens)})


def test_eval_ratios_are_sums_over_sums_of_every_batch():
  model, lm_engine, batches = _uneven_eval()
  engine = dataclasses.replace(lm_engine, objective=_objective_with_a_ratio, evals={})
  got = evaluation.evaluate(engine, engine.init_state(model, {}, seed=0), batches)
  first = [float(np.sum(b["loss_mask_BxL"][0] > 0)) for b in batches]
  kept = [float(np.sum(b["loss_mask_BxL"] > 0)) for b in batches]
  assert got["eval_first_row_share"] == pytest.approx(sum(first) / sum(kept), rel=1e-6)
  assert abs(np.mean(np.divide(first, kept)) - sum(first) / sum(kept)) > 1e-2  # not a mean


def test_perplexity_overflow_and_empty_eval():
  assert evaluation.loss_and_perplexity(6.0, 3)["perplexity"] == pytest.approx(math.exp(2.0))
  huge = evaluation.loss_and_perplexity(1e6, 2)
  assert huge["loss"] == 5e5 and huge["perplexity"] == math.inf
  with pytest.raises(UserError, match="no tokens.*train.eval_batches"):
    evaluation.loss_and_perplexity(0.0, 0)


def test_per_token_values_count_the_rows_the_objective_counts():
  """An eval objective over the tokenizer's first 100 of the model's 128 rows (as every recipe
  wraps its own, framework/token_rows.py): the per-token NLL and top-1 are numpy's over those
  100 logits, and their masked mean is the eval loss (issue 55: the demo compared a GGUF, which
  holds only those rows, with the per-token values of all 128)."""
  from distillax.framework import token_rows
  mesh, rules = mesh_and_rules("fsdp_tp", 4, 2)
  model = create_model(TINY, mesh=mesh, rules=rules, seed=3)
  batches = packed_batches(2, seed=5, vocab=100)
  engine = tiny_engine(model, batches[0], mesh, rules,
                       objective=token_rows.over_token_rows(lm_objective, 100), compile_now=False)
  means, tokens = evaluation.evaluate(engine, engine.init_state(model, {}, seed=0), batches,
                                      per_token=True)
  total = 0.0
  for batch, nll_BxL, top1_BxL in zip(batches, tokens.nll_BxL, tokens.top1_BxL):
    logits = np.asarray(model(batch["inputs_BxL"], **losses.model_inputs(batch)).logits_BxLxV,
                        np.float64)[..., :100]
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = -np.take_along_axis(log_probs, batch["targets_BxL"][..., None], -1)[..., 0]
    np.testing.assert_allclose(nll_BxL, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(top1_BxL, logits.argmax(-1))
    total += float(np.sum(nll_BxL.astype(np.float64) * batch["loss_mask_BxL"]))
  assert total / means["eval_tokens"] == pytest.approx(means["eval_loss"], rel=1e-6)
