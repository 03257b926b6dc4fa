"""Several teachers (multi_teacher.py): mixture and routing against single-teacher KD and numpy,
over vocabulary slices against the chunk engine, and over a recipe's token rows through every
engine against numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.distill import LogitKD, make_distill_objective
from distillax.distill.multi_teacher import TEACHER_INDEX, TeacherMix
from distillax.distill.teacher_cache import read_teacher_cache, write_teacher_cache
from distillax.distill.teacher_head import TEACHER_HIDDEN, load_head
from distillax.errors import ConfigError
from distillax.framework import token_loss_impl, token_rows, vocab_slices
from tests.distill import helpers as h
from tests.support import chip
from tests.support.models import NORMS_NEAR_ONE, random_model

KD = LogitKD(temperature=2.0, alpha=0.7)
CHUNK = 4  # tokens per vocabulary chunk: the chunked path, where teachers are combined per chunk
SINGLE = make_distill_objective(KD, chunk_size=CHUNK, metrics=False)
_COMPILED = {}


@functools.cache
def objective_of(mode=None, weights=()):
  if mode is None:
    return SINGLE
  mix = TeacherMix(("a", "b"), mode, weights, temperature=KD.temperature)
  return make_distill_objective(KD, chunk_size=CHUNK, metrics=False, teachers=mix)


@pytest.fixture(scope="module")
def models():
  student, teacher = h.make_models(0)
  other = random_model(h.TEACHER_CONFIG, 321, NORMS_NEAR_ONE)
  return student, teacher, other


def run(objective, student, extras, batch):
  """One jit per objective (reused across calls of the same shapes)."""
  fn = _COMPILED.setdefault(id(objective), jax.jit(lambda s, e, b: objective(s, e, b, None)))
  out = fn(student, extras, h.to_jnp(batch))
  return float(out.loss_sum), {k: float(v) for k, v in out.sums.items()}


def routed_batch(index_per_row):
  batch = h.make_batch()
  B, L = batch["loss_mask_BxL"].shape
  batch[TEACHER_INDEX] = np.repeat(np.asarray(index_per_row, np.int32)[:, None], L, axis=1)
  return batch


def test_identical_teachers_equal_one_teacher(models):
  student, teacher, _ = models
  batch = routed_batch([1, 0])
  single = run(SINGLE, student, {"teacher": teacher}, batch)
  extras = {"teacher:a": teacher, "teacher:b": teacher}
  for mode in ("mixture", "routing"):
    loss, sums = run(objective_of(mode, (1.0, 3.0)), student, extras, batch)
    np.testing.assert_allclose(loss, single[0], rtol=1e-6, err_msg=mode)
    for k in single[1]:
      np.testing.assert_allclose(sums[k], single[1][k], rtol=1e-6, err_msg=f"{mode} {k}")


def test_routing_sends_each_row_to_its_teacher(models):
  """Routed KD of rows [teacher b, teacher a] = row 0 alone with b + row 1 alone with a (a row
  alone: the other row's loss mask zeroed; rows never interact in the forward)."""
  student, teacher_a, teacher_b = models
  batch = routed_batch([1, 0])
  routed, _ = run(objective_of("routing"), student,
                  {"teacher:a": teacher_a, "teacher:b": teacher_b}, batch)

  def alone(row, teacher):
    only = dict(batch, loss_mask_BxL=batch["loss_mask_BxL"] * (np.arange(2) == row)[:, None])
    return run(SINGLE, student, {"teacher": teacher}, only)[0]

  np.testing.assert_allclose(routed, alone(0, teacher_b) + alone(1, teacher_a), rtol=1e-6)
  assert abs(alone(0, teacher_a) - alone(0, teacher_b)) > 1e-3  # the teachers do differ


def test_mixture_of_two_teachers_matches_numpy(models):
  """The KD target is w_a softmax(t_a / T) + w_b softmax(t_b / T), in float64."""
  student, teacher_a, teacher_b = models
  batch = routed_batch([1, 0])  # the index is unread by a mixture (its shapes: one compile)
  _, sums = run(objective_of("mixture", (1.0, 3.0)), student,
                {"teacher:a": teacher_a, "teacher:b": teacher_b}, batch)
  forward = jax.jit(lambda m, b: m(b["inputs_BxL"], positions_BxL=b["positions_BxL"],
                                   segment_ids_BxL=b["segment_ids_BxL"]).logits_BxLxV)
  logits = lambda m: h.f64(forward(m, h.to_jnp(batch))).reshape(-1, h.VOCAB)
  T = KD.temperature
  p = (0.25 * np.exp(h.np_log_softmax(logits(teacher_a) / T))
       + 0.75 * np.exp(h.np_log_softmax(logits(teacher_b) / T)))
  q = np.exp(h.np_log_softmax(logits(student) / T))
  keep = batch["loss_mask_BxL"].reshape(-1) > 0
  np.testing.assert_allclose(sums["logit_kd_divergence"], h.np_kl(p, q)[keep].sum(), rtol=1e-5)


def test_weights_and_names_refused():
  with pytest.raises(ConfigError, match="sum to a positive number"):
    TeacherMix(("a", "b"), "mixture", (0.0, 0.0))
  with pytest.raises(ConfigError, match="'c', which is not one of"):
    TeacherMix(("a", "b"), "routing").index_of("c", "data.teacher_routes")


def test_a_hidden_state_cache_stands_in_for_a_teacher(models, tmp_path):
  """Teacher a from its fp32 hidden-state cache (written and read back in the cache's format,
  its head loaded and fingerprint-checked) + live teacher b = live a + live b."""
  student, teacher_a, teacher_b = models
  batch = routed_batch([1, 0])
  info = write_teacher_cache(teacher_a, [batch], str(tmp_path), kind="hidden",
                             hidden_dtype="float32")
  rows = read_teacher_cache(str(tmp_path))
  with_states = dict(batch, **{TEACHER_HIDDEN: np.stack([rows[i][TEACHER_HIDDEN]
                                                         for i in range(len(rows))])})
  np.testing.assert_array_equal(np.stack([rows[i]["inputs_BxL"] for i in range(len(rows))]),
                                batch["inputs_BxL"])
  head = load_head(str(tmp_path), info.head_fingerprint)
  objective = objective_of("mixture", (1.0, 3.0))
  live = run(objective, student, {"teacher:a": teacher_a, "teacher:b": teacher_b}, batch)
  cached = run(objective, student, {"teacher:a": head, "teacher:b": teacher_b}, with_states)
  np.testing.assert_allclose(cached[0], live[0], rtol=1e-5)
  for k in live[1]:
    np.testing.assert_allclose(cached[1][k], live[1][k], rtol=1e-5, err_msg=k)


def padded_teacher(model, pad=16, seed=9):
  """`model` with its vocabulary padded by `pad` rows of large random weights: its logits at the
  first V ids are the model's, those past them arbitrary."""
  big = random_model(model.config.replace(vocab_size=model.config.vocab_size + pad), seed)
  graph, state = nnx.split(big)
  rng = np.random.default_rng(seed)

  def fill(padded, value):
    value = np.asarray(value)
    if value.shape == padded.shape:
      return jnp.asarray(value)
    axis = next(i for i, (a, b) in enumerate(zip(value.shape, padded.shape)) if a != b)
    extra = list(value.shape)
    extra[axis] = pad
    return jnp.asarray(np.concatenate([value, 5 * rng.standard_normal(extra)], axis), value.dtype)

  pure = jax.tree.map(fill, nnx.to_pure_dict(state), nnx.to_pure_dict(nnx.split(model)[1]))
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graph, state)


def test_a_teacher_padded_past_the_students_vocabulary_is_cut_to_it(models):
  """Gemma 3 27B's 262,208-row table over the 1B's 262,144: the padded teacher's extra logits
  (arbitrary here) leave the KD loss and its gradient as the unpadded teacher's, alone and as
  one of several teachers (each teacher is cut, not their side-by-side logits)."""
  student, teacher_a, teacher_b = models
  padded = padded_teacher(teacher_a)
  batch = routed_batch([1, 0])
  graph, state = nnx.split(student)
  loss_fn = jax.jit(jax.value_and_grad(
      lambda state, extras: SINGLE(nnx.merge(graph, state), extras, h.to_jnp(batch),
                                   None).loss_sum))
  want, want_grad = loss_fn(state, {"teacher": teacher_a})
  got, grad = loss_fn(state, {"teacher": padded})
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(want_grad), jax.tree.leaves(grad)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-9)
  mixture = objective_of("mixture", (1.0, 3.0))
  want = run(mixture, student, {"teacher:a": teacher_a, "teacher:b": teacher_b}, batch)
  got = run(mixture, student, {"teacher:a": padded, "teacher:b": teacher_b}, batch)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  # The cut rows would move the loss: their output weights are 5x the others'.
  extra = np.asarray(padded.lm_head[...])[:, h.VOCAB:]
  assert np.abs(extra).mean() > 3 * np.abs(np.asarray(teacher_a.lm_head[...])).mean()
  narrow = random_model(h.TEACHER_CONFIG.replace(vocab_size=h.VOCAB - 8), 5)
  with pytest.raises(ConfigError, match=f"student vocabulary \\({h.VOCAB}\\) is wider than the "
                                        f"teacher's \\({h.VOCAB - 8}\\)"):
    SINGLE(student, {"teacher": narrow}, h.to_jnp(batch), None)


# ---- several teachers over vocabulary slices (framework/slice_teachers.py) -----------------------

def _value_and_grads(objective, student, extras, batch):
  """(output, gradients by parameter path) of the loss sum."""
  graph, state = nnx.split(student)

  def loss(state):
    out = objective(nnx.merge(graph, state), extras, batch, None)
    return out.loss_sum, out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  return out, nnx.to_pure_dict(grads)


def _assert_same(got, want):
  (out, grads), (want_out, want_grads) = got, want
  chip.assert_close(out.loss_sum, want_out.loss_sum, rtol=1e-5)
  assert sorted(out.sums) == sorted(want_out.sums)
  for k in out.sums:
    chip.assert_close(out.sums[k], want_out.sums[k], rtol=1e-5, err_msg=k)
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want_grads),
                          jax.tree.leaves(grads)):
    chip.assert_close(g, w, atol=1e-5 * max(float(np.max(np.abs(w))), 1e-6),
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mode,weights", [("mixture", (1.0, 3.0)), ("mixture", (0.0, 2.0)),
                                          ("routing", ())])
@pytest.mark.parametrize("metrics", [False, True])
def test_several_teachers_over_slices_equal_the_chunk_engine(models, mode, weights, metrics,
                                                             monkeypatch):
  """Two teachers, mixed (one weight 0: that teacher drops out) or routed per row, over slices
  of 20 of the 48 columns (the last shifted back): the loss, every sum (an eval's teacher_ce,
  top1_agreement and logit_cosine too) and every student gradient within 1e-5 of the chunk
  engine's (every column a token here: outside a recipe)."""
  student, teacher_a, teacher_b = models
  monkeypatch.setattr(vocab_slices, "slice_size_for", lambda tokens, vocab, requested=0: 20)
  mix = TeacherMix(("a", "b"), mode, weights, temperature=KD.temperature)
  extras = {"teacher:a": teacher_a, "teacher:b": teacher_b}
  batch = h.to_jnp(routed_batch([1, 0]))
  want = _value_and_grads(make_distill_objective(KD, chunk_size=CHUNK, metrics=metrics,
                                                 teachers=mix), student, extras, batch)
  with token_loss_impl.recorded_choices() as ran:
    got = _value_and_grads(make_distill_objective(KD, metrics=metrics, teachers=mix,
                                                  sliced=True), student, extras, batch)
  assert [k.split(" (")[0] for k in ran] == ["sliced"]
  _assert_same(got, want)


@pytest.mark.parametrize("engine", ["sliced", "chunked", "whole"])
@pytest.mark.parametrize("mode", ["mixture", "routing"])
def test_several_teachers_fold_the_token_columns_alone(models, mode, engine):
  """Traced over 40 token rows of the 48 (a recipe's padded vocabulary), over vocabulary
  slices, token chunks or whole logits: the KD sums equal float64 numpy's over each teacher's
  first 40 columns, folded as the mode says (the mixture of weights 1 and 3 of their softmaxes
  at T, or each row's own teacher). The chunks masked the teachers' K * V columns as one
  teacher's (all of teacher b's: a loss of 24,517 for 26.27 here), and whole logits cut them to
  V columns (a shape error)."""
  student, teacher_a, teacher_b = models
  rows = 40
  mix = TeacherMix(("a", "b"), mode, (1.0, 3.0), temperature=KD.temperature)
  extras = {"teacher:a": teacher_a, "teacher:b": teacher_b}
  batch = h.to_jnp(routed_batch([1, 0]))
  batch = {**batch, "targets_BxL": jnp.minimum(batch["targets_BxL"], rows - 1)}
  objective = make_distill_objective(KD, metrics=True, teachers=mix, sliced=engine == "sliced",
                                     chunk_size=None if engine == "whole" else CHUNK)
  with token_rows.limited_to(rows):
    out = jax.jit(lambda s, e, b: objective(s, e, b, None))(student, extras, batch)
  cut = lambda m: h.f64(m(batch["inputs_BxL"], positions_BxL=batch["positions_BxL"],
                          segment_ids_BxL=batch["segment_ids_BxL"]).logits_BxLxV)[..., :rows]
  s, a, b = (cut(m).reshape(-1, rows) for m in (student, teacher_a, teacher_b))
  T = KD.temperature
  if mode == "mixture":
    p = (np.exp(h.np_log_softmax(a / T)) + 3 * np.exp(h.np_log_softmax(b / T))) / 4
    t = T * np.log(p)  # logits whose softmax at T is the mixture
  else:  # row 0 to teacher b, row 1 to teacher a
    t = np.where(np.repeat([True, False], len(s) // 2)[:, None], b, a)
  y = np.asarray(batch["targets_BxL"]).reshape(-1)
  m = h.f64(batch["loss_mask_BxL"]).reshape(-1)
  loss, div = h.np_logit_kd(s, t, y, temperature=T, alpha=KD.alpha)
  np.testing.assert_allclose(out.sums["logit_kd"], np.sum(loss * m), rtol=1e-5)
  np.testing.assert_allclose(out.sums["logit_kd_divergence"], np.sum(div * m), rtol=1e-5)
  want = h.np_metrics(s, t, y, m)
  np.testing.assert_allclose(out.sums["teacher_ce"], want["teacher_ce"], rtol=1e-5)
  np.testing.assert_allclose(out.sums["logit_cosine"], want["logit_cosine"], rtol=1e-5)
  assert float(out.sums["top1_agreement"]) == want["top1_agreement"]
