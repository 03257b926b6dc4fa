"""A strategy of several logit terms (a Composite of LogitKDs, each its own temperature,
divergence, alpha and weight) over vocabulary slices (framework/slice_terms.py) against the
chunk engine: the loss, every sum it reports (each leaf's `{name}` and `{name}_divergence`,
hard_ce, an eval's teacher_ce, top1_agreement and logit_cosine) and every student gradient
(its output layer's and, through the hidden states, every layer's); over a padded vocabulary
against whole logits; from several teachers; and the one-line refusals of what stays on the
chunk engine."""

import jax
import numpy as np
import pytest

from distillax.distill import CachedLogitKD, LogitKD, make_distill_objective
from distillax.distill.multi_teacher import TeacherMix
from distillax.errors import ConfigError
from distillax.framework import token_loss_impl, token_rows, vocab_slices
from tests.distill import helpers as h
from tests.distill.test_multi_teacher import _assert_same, _value_and_grads
from tests.support.models import NORMS_NEAR_ONE, random_model

CHUNK = 4  # tokens per vocabulary chunk: the reference engine

STRATEGIES = {
    "two_forward_kl_at_two_temperatures":
        LogitKD(temperature=2.0, alpha=0.7, name="hot")
        + LogitKD(temperature=1.0, alpha=0.4, weight=0.5, name="cold"),
    "forward_kl_and_jsd":
        LogitKD(temperature=2.0, alpha=0.7, name="fkl")
        + LogitKD(temperature=1.5, alpha=0.9, divergence="jsd", beta=0.3, weight=2.0, name="js"),
    "reverse_kl_and_forward_kl_different_alphas":
        LogitKD(temperature=2.0, alpha=0.2, divergence="reverse_kl", name="rkl")
        + LogitKD(temperature=2.0, alpha=1.0, weight=0.7, name="fkl"),
}


@pytest.fixture(scope="module")
def models():
  student, teacher = h.make_models(0)
  return student, teacher, random_model(h.TEACHER_CONFIG, 321, NORMS_NEAR_ONE)


def _sliced(strategy, student, extras, batch, **kwargs):
  """(output, gradients) over vocabulary slices, and that they ran there."""
  with token_loss_impl.recorded_choices() as ran:
    got = _value_and_grads(make_distill_objective(strategy, sliced=True, **kwargs), student,
                           extras, batch)
  assert [k.split(" (")[0] for k in ran] == ["sliced"]
  return got


@pytest.mark.parametrize("metrics", [False, True])
@pytest.mark.parametrize("case", STRATEGIES)
def test_several_logit_terms_over_slices_equal_the_chunk_engine(models, case, metrics,
                                                                monkeypatch):
  """36 token rows (a packed row and a padded one, some tokens masked), slices of 20 of the 48
  columns (the last shifted back): loss, every sum and every gradient within 1e-5 of the chunk
  engine's; each leaf's sums under its own name."""
  student, teacher, _ = models
  monkeypatch.setattr(vocab_slices, "slice_size_for", lambda tokens, vocab, requested=0: 20)
  strategy = STRATEGIES[case]
  batch = h.to_jnp(h.make_batch(B=4, L=9))
  assert 0 < float(batch["loss_mask_BxL"].sum()) < 36
  extras = {"teacher": teacher}
  want = _value_and_grads(make_distill_objective(strategy, chunk_size=CHUNK, metrics=metrics),
                          student, extras, batch)
  got = _sliced(strategy, student, extras, batch, metrics=metrics)
  names = [leaf.name for _, leaf in strategy.leaves()]
  assert {*names, *(f"{n}_divergence" for n in names), "hard_ce"} <= set(got[0].sums)
  _assert_same(got, want)


def test_several_terms_over_a_padded_vocabulary_equal_whole_logits(models):
  """Traced over 40 token rows of the 48: every term's softmax over the token columns alone,
  the loss, sums and gradients equal the whole-logits objective's (the padded rows get none)."""
  student, teacher, _ = models
  strategy = STRATEGIES["forward_kl_and_jsd"]
  batch = h.to_jnp(h.make_batch(B=4, L=9, vocab=40))
  extras = {"teacher": teacher}

  def over_rows(objective):
    return lambda m, e, b, r: token_rows.over_token_rows(objective, 40)(m, e, b, r)

  want = _value_and_grads(over_rows(make_distill_objective(strategy, chunk_size=None)),
                          student, extras, batch)
  with token_loss_impl.recorded_choices() as ran:
    got = _value_and_grads(over_rows(make_distill_objective(strategy, sliced=True)), student,
                           extras, batch)
  assert [k.split(" (")[0] for k in ran] == ["sliced"]
  _assert_same(got, want)
  head = np.asarray(got[1]["lm_head"]) if "lm_head" in got[1] else np.asarray(
      got[1]["embedder"]["embedding"]).T
  assert np.all(head[:, 40:] == 0) and np.any(head[:, :40] != 0)


@pytest.mark.parametrize("mode,weights", [("mixture", (1.0, 3.0)), ("routing", ())])
def test_several_terms_from_several_teachers_equal_the_chunk_engine(models, mode, weights,
                                                                    monkeypatch):
  """Two teachers mixed or routed per row, folded once per slice, read by two terms at their
  own temperatures: an eval objective's loss, sums and gradients equal the chunk engine's."""
  from tests.distill.test_multi_teacher import routed_batch
  student, teacher_a, teacher_b = models
  monkeypatch.setattr(vocab_slices, "slice_size_for", lambda tokens, vocab, requested=0: 20)
  strategy = STRATEGIES["two_forward_kl_at_two_temperatures"]
  mix = TeacherMix(("a", "b"), mode, weights, temperature=2.0)
  extras = {"teacher:a": teacher_a, "teacher:b": teacher_b}
  batch = h.to_jnp(routed_batch([1, 0]))
  want = _value_and_grads(make_distill_objective(strategy, chunk_size=CHUNK, teachers=mix),
                          student, extras, batch)
  _assert_same(_sliced(strategy, student, extras, batch, teachers=mix), want)


@pytest.mark.parametrize("strategy,names", [
    (LogitKD(name="a") + LogitKD(name="b", temperature=1.0, top_k=8),
     "LogitKD(a), LogitKD(b)"),
    (CachedLogitKD(name="a") + LogitKD(name="b"), "CachedLogitKD(a), LogitKD(b)"),
])
def test_several_terms_with_a_top_k_or_a_cache_are_refused_in_one_line(strategy, names):
  """Each top-k would take its own bucket pass: the chunk engine keeps them, said in one line
  naming the fix."""
  with pytest.raises(ConfigError) as e:
    make_distill_objective(strategy, metrics=False, sliced=True)
  message = str(e.value)
  assert f"this job has {names}: set --config.train.loss_impl=chunked" in message
  assert "LogitKDs over the whole vocabulary (no top_k, no cache)" in message
  assert "\n" not in message
