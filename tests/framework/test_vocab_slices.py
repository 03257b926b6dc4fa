"""Token losses over vocabulary slices (`train.loss_impl='sliced'`) against the whole-logits
formulas in float64 numpy, and against the vocabulary-chunk engine inside the real objectives:
the lm objective's CE and accuracy, and a distill objective's LogitKD (forward KL at T with the
hard-label mix), loss, sums and every gradient, also under fsdp on 8 devices. The one-device
comparisons also run on a TPU in the chip run (scripts/chip_tests.sh, tests/support/chip.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import partitioning as pt
from distillax.distill import LogitKD, make_distill_objective
from distillax.errors import ConfigError
from distillax.framework import token_loss_impl, vocab_slices
from distillax.models.presets import get_preset
from distillax.trainers import lm_objective
from tests.distill.helpers import (STUDENT_CONFIG, TEACHER_CONFIG, f64, make_batch, make_models,
                                   np_log_softmax, to_jnp)
from tests.framework.test_chunked_loss import _batch
from tests.support import chip
from tests.support.models import random_model


def _numpy_terms(s, t, y, T):
  """Per-token NLL, KL(p_t^T || p_s^T) and argmax hit from whole float64 logits."""
  logp = np_log_softmax(s)
  nll = -logp[np.arange(len(y)), y]
  lt, ls = np_log_softmax(f64(t) / T), np_log_softmax(f64(s) / T)
  kl = np.sum(np.exp(lt) * (lt - ls), axis=-1)
  return nll, kl, (np.argmax(s, -1) == y).astype(np.float64)


@pytest.mark.parametrize("slice_size,vocab_axis,softcap", [(128, 0, None), (96, 1, 5.0),
                                                           (1000, 0, None)])
def test_sums_and_gradients_equal_the_whole_logits_formulas(slice_size, vocab_axis, softcap):
  """V = 300 in slices of 128 (the last one shifted back over 44 columns already seen), 96
  (an untied head, soft-capped logits) or one slice; a teacher head 20 columns wider than the
  student's (a padded table: only the student's columns count). Sums within 1e-5 of float64
  numpy; the weight and hidden-state gradients within 1e-5 of jax.grad through whole logits."""
  N, D, Dt, V, T = 37, 16, 24, 300, 2.0
  k = jax.random.split(jax.random.key(0), 6)
  w = jax.random.normal(k[0], (V, D) if vocab_axis == 0 else (D, V)) * 0.3
  h = jax.random.normal(k[1], (N, D))
  w_t = jax.random.normal(k[2], (Dt, V + 20)) * 0.3
  h_t = jax.random.normal(k[3], (N, Dt))
  y = jax.random.randint(k[4], (N,), 0, V)
  mask = (jax.random.uniform(k[5], (N,)) > 0.2).astype(jnp.float32)
  spec = vocab_slices.Spec(kd_weight=0.7 * T * T, ce_weight=0.3, temperature=T, accuracy=True,
                           slice_size=slice_size)
  cap = (lambda z: z) if softcap is None else (lambda z: softcap * jnp.tanh(z / softcap))

  def whole(w, h):
    s = cap(h @ (w.T if vocab_axis == 0 else w))
    t = (h_t @ w_t)[:, :V]
    nll = jax.nn.logsumexp(s, -1) - jnp.take_along_axis(s, y[:, None], -1)[:, 0]
    p = jax.nn.softmax(t / T, -1)
    kl = jnp.sum(p * (jax.nn.log_softmax(t / T, -1) - jax.nn.log_softmax(s / T, -1)), -1)
    return jnp.sum((spec.kd_weight * kl + spec.ce_weight * nll) * mask), s

  def sliced(w, h):
    return vocab_slices.token_sums(spec, vocab_slices.Head(w, vocab_axis, "float32", softcap), h,
                                   y, mask, vocab_slices.Head(w_t, 1, "float32"), h_t)

  with jax.default_matmul_precision("highest"):
    (loss, sums), grads = jax.value_and_grad(sliced, argnums=(0, 1), has_aux=True)(w, h)
    (want_loss, s), want_grads = jax.value_and_grad(whole, argnums=(0, 1), has_aux=True)(w, h)
    t = (h_t @ w_t)[:, :V]
  nll, kl, hit = _numpy_terms(s, t, np.asarray(y), T)
  m = f64(mask)
  chip.assert_close(sums["nll"], np.sum(nll * m), rtol=1e-5)
  chip.assert_close(sums["kl"], np.sum(kl * m), rtol=1e-5)
  assert float(sums["correct"]) == np.sum(hit * m)
  chip.assert_close(loss, want_loss, rtol=1e-5)
  for g, want in zip(grads, want_grads):
    chip.assert_close(g, want, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def _grads_of(objective, student, extras, batch):
  graphdef, state = nnx.split(student)

  def f(state):
    out = objective(nnx.merge(graphdef, state), extras, batch, jax.random.key(0))
    return out.loss_sum / out.tokens, out

  (_, out), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(state)
  return out, jax.tree.leaves(nnx.to_pure_dict(grads))


def _assert_same(got, want, atol):
  """On a TPU each array within chip.F32 of its scale (tests/support/chip.py)."""
  (out, grads), (out_want, grads_want) = got, want
  chip.assert_close(out.loss_sum, out_want.loss_sum, rtol=1e-5)
  assert sorted(out.sums) == sorted(out_want.sums)
  for k in out.sums:
    chip.assert_close(out.sums[k], out_want.sums[k], rtol=1e-5, err_msg=k)
  assert len(grads) == len(grads_want)
  for g, w in zip(grads, grads_want):
    chip.assert_close(g, w, atol=atol)


@pytest.mark.parametrize("preset", ["tiny", "tiny_gemma"])
def test_lm_objective_sliced_equals_the_chunk_engine(preset):
  """Loss, accuracy and every parameter's gradient; the tiny model's untied head and
  tiny_gemma's tied embedding (soft-capped logits), in slices of the auto size (one slice)
  and in 3 slices of 96 columns of its 256."""
  cfg = get_preset(preset).replace(num_layers=1)
  model = random_model(cfg, seed=1)
  batch = _batch(B=4, L=13)
  want = _grads_of(lm_objective, model, {}, batch)
  with token_loss_impl.recorded_choices() as ran:
    got = _grads_of(lambda *a: lm_objective(*a, loss_impl="sliced"), model, {}, batch)
  assert list(ran) == ["sliced (vocabulary slices: 1 of 256 columns x 52 positions)"]
  _assert_same(got, want, atol=2e-6)
  real = vocab_slices.slice_size_for
  try:
    vocab_slices.slice_size_for = lambda tokens, vocab, requested=0: 96
    got = _grads_of(lambda *a: lm_objective(*a, loss_impl="sliced"), model, {}, batch)
  finally:
    vocab_slices.slice_size_for = real
  _assert_same(got, want, atol=2e-6)


@pytest.fixture(scope="module")
def distill_case():
  """LogitKD (T=2, alpha 0.7) from a wider teacher: (sliced objective, student, extras, batch,
  the chunk engine's output and gradients)."""
  student, teacher = make_models()
  batch = to_jnp(make_batch(B=8, L=9))
  kd = LogitKD(temperature=2.0, alpha=0.7)
  extras = {"teacher": teacher}
  want = _grads_of(make_distill_objective(kd, metrics=False), student, extras, batch)
  assert STUDENT_CONFIG.vocab_size == TEACHER_CONFIG.vocab_size
  return make_distill_objective(kd, metrics=False, sliced=True), student, extras, batch, want


def test_distill_objective_sliced_equals_the_chunk_engine(distill_case):
  """On one device: the loss, its logit_kd / logit_kd_divergence / hard_ce sums and the
  student's every gradient agree within 1e-5."""
  sliced, student, extras, batch, want = distill_case
  with token_loss_impl.recorded_choices() as ran:
    got = _grads_of(sliced, student, extras, batch)
  assert [k.split(" (")[0] for k in ran] == ["sliced"]
  _assert_same(got, want, atol=1e-5)


def test_distill_objective_sliced_equals_the_chunk_engine_under_fsdp(distill_case):
  """The same under fsdp on 8 x 1 devices, against the one-device chunk engine."""
  sliced, student, extras, batch, want = distill_case
  mesh = pt.create_mesh({"data": 8, "model": 1})
  with pt.use_rules(mesh, pt.rules_from_config({"strategy": "fsdp"})):
    _assert_same(_grads_of(sliced, student, extras, batch), want, atol=1e-5)


@pytest.mark.parametrize("strategy,message", [
    (LogitKD(divergence="reverse_kl"), "this job has LogitKD(logit_kd)"),
    (LogitKD(top_k=4), "one forward-KL LogitKD (top_k None)"),
])
def test_sliced_refuses_what_it_does_not_compute(strategy, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    make_distill_objective(strategy, metrics=False, sliced=True)


@pytest.mark.parametrize("job,sliced,why_not,message", [
    ("on_policy", False, None, "the on_policy job's train losses are not ones vocabulary "
                               "slices compute"),
    ("lm", True, "lora.module_regex adapts the student",
     "train.loss_impl='sliced' cannot take this output layer: lora.module_regex"),
])
def test_the_config_refuses_sliced_in_one_line(job, sliced, why_not, message):
  with pytest.raises(ConfigError) as e:
    token_loss_impl.check_loss_impl("sliced", job, sliced=sliced, sliced_why_not=why_not)
  assert message in str(e.value) and "\n" not in str(e.value)
  token_loss_impl.check_loss_impl("sliced", "lm", sliced=True)
  assert token_loss_impl.resolve_loss_impl("auto", sliced, why_not) == (
      "sliced" if sliced and not why_not else "chunked")


@pytest.mark.parametrize("rules,refused", [
    ((("", None, None, None), (".*", "q4_0", "q8_0", None)), False),  # the README's llama.cpp QAT
    (((".*", "int8", "int8", None),), True),  # '.*' matches the top module: the head is quantized
])
def test_qat_keeps_the_slices_only_while_the_output_layer_stays_full_precision(rules, refused):
  from distillax.configs.qat import get_config
  from distillax.trainers.recipe import sliced_loss_refusal
  config = get_config("tiny")
  config.qat.rules = rules
  why = sliced_loss_refusal(config)
  assert (why is not None) == refused
  if refused:
    assert why.startswith("qat.rules quantize the output layer") and "('', None" in why
