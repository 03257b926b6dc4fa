"""make_distill_objective on tiny real models: values vs numpy, gradients, frozen teacher."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from distillax.distill import (AttentionTransfer, CachedLogitKD, DistillStudent, FeaturePooling,
                               FeatureProjection, LogitKD, make_distill_objective, run_models)
from distillax.errors import ConfigError
from distillax.framework.state import build_layout, init_state
from distillax.framework.step import make_train_step
from distillax.models.transformer import Transformer
from tests.distill import helpers as h
from tests.support.models import NORMS_NEAR_ONE, random_model

STRATEGY = (LogitKD(temperature=1.5, alpha=0.6, top_k=5)
            + 0.5 * AttentionTransfer({0: 1, 1: 2})
            + FeaturePooling({2: 3}, loss="mse", weight=0.2)
            + FeatureProjection({1: 2}, weight=0.3))


def setup(strategy=STRATEGY, seed=0):
  model, teacher = h.make_models(seed)
  student = DistillStudent(model, strategy, teacher_embed_dim=h.TEACHER_CONFIG.embed_dim,
                           rngs=nnx.Rngs(seed + 7))
  return student, teacher, h.make_batch(seed=seed)


def test_composite_objective_matches_numpy():
  student, teacher, batch = setup()
  objective = make_distill_objective(STRATEGY)
  sg, ss = nnx.split(student)
  tg, ts = nnx.split(teacher)

  @jax.jit
  def run(ss, ts, batch):
    student, extras = nnx.merge(sg, ss), {"teacher": nnx.merge(tg, ts)}
    out = objective(student, extras, batch, None)
    inputs = run_models(STRATEGY, student, extras, batch)
    return out, inputs.student, inputs.teacher

  out, s, t = run(ss, ts, h.to_jnp(batch))
  mask = batch["loss_mask_BxL"]
  keep = mask.reshape(-1) > 0
  V = h.VOCAB
  s_logits = np.asarray(s.logits_BxLxV).reshape(-1, V)
  t_logits = np.asarray(t.logits_BxLxV).reshape(-1, V)
  targets = batch["targets_BxL"].reshape(-1)
  kd_tok, _ = h.np_logit_kd(s_logits, t_logits, targets, temperature=1.5, alpha=0.6, top_k=5)
  kernel = h.f64(student.projections["feature_projection"][0].kernel[...])
  ref = {"logit_kd": kd_tok[keep].sum(),
         "attention_transfer": h.np_attention_term("kl", s.attention_probs, t.attention_probs,
                                                   {0: 1, 1: 2}, mask),
         "feature_pooling": h.np_feature_term("mse", s.hidden_states[2],
                                              h.np_pool(t.hidden_states[3], 16), mask),
         "feature_projection": h.np_feature_term("cosine", h.f64(s.hidden_states[1]) @ kernel,
                                                 t.hidden_states[2], mask)}
  ref.update(h.np_metrics(s_logits, t_logits, targets, mask.reshape(-1)))
  for name, value in ref.items():
    np.testing.assert_allclose(float(out.sums[name]), value, rtol=2e-5, err_msg=name)
  expected_loss = (ref["logit_kd"] + 0.5 * ref["attention_transfer"] + 0.2 * ref["feature_pooling"]
                   + 0.3 * ref["feature_projection"])
  np.testing.assert_allclose(float(out.loss_sum), expected_loss, rtol=2e-5)
  assert float(out.tokens) == mask.sum()


def test_weights_compose():
  a, b = LogitKD(), AttentionTransfer({0: 0})
  combo = 2.0 * (a + 0.25 * b)
  assert [(w, leaf.name) for w, leaf in combo.leaves()] == [(2.0, "logit_kd"),
                                                            (0.5, "attention_transfer")]
  nested = (a + b) + FeaturePooling({0: 0})
  assert len(nested.strategies) == 3


def test_gradient_reaches_student_and_projection_only():
  student, teacher, batch = setup()
  objective = make_distill_objective(STRATEGY)
  sg, ss = nnx.split(student)
  tg, ts = nnx.split(teacher)

  def loss(ss, ts):
    return objective(nnx.merge(sg, ss), {"teacher": nnx.merge(tg, ts)}, h.to_jnp(batch),
                     None).loss_sum

  gs, gt = jax.jit(jax.grad(loss, argnums=(0, 1)))(ss, ts)
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(gt))
  g = nnx.to_pure_dict(gs)
  assert float(jnp.max(jnp.abs(g["projections"]["feature_projection"][0]["kernel"]))) > 0
  model_leaves = jax.tree.leaves(g["model"])
  assert sum(float(jnp.max(jnp.abs(x))) > 0 for x in model_leaves) >= len(model_leaves) - 1


def test_teacher_bit_identical_after_a_train_step():
  student, teacher, batch = setup(seed=1)
  tx = optax.adamw(1e-2, weight_decay=0.1)
  layout = build_layout(student, {"teacher": teacher}, tx, None, None)
  state = init_state(student, {"teacher": teacher}, tx, layout, seed=0)
  teacher_before = jax.tree.map(np.array, state.frozen["teacher"])
  params_before = jax.tree.map(np.array, state.params)
  step = jax.jit(make_train_step(layout.defs, make_distill_objective(STRATEGY), tx,
                                 optax.constant_schedule(1e-2)))
  new_state, metrics = step(state, h.to_jnp(batch))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(b), a), teacher_before,
               new_state.frozen["teacher"])
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(b) != a)), params_before,
                         new_state.params)
  assert changed["projections"]["feature_projection"][0]["kernel"]
  assert changed["model"]["embedder"]["embedding"]
  assert np.isfinite(float(metrics["loss"]))
  for name in ("logit_kd", "hard_ce", "teacher_ce", "top1_agreement", "logit_cosine"):
    assert name in metrics


def _recorded_flags(strategy, extras_teacher=True):
  student, teacher, batch = setup(strategy)
  if not extras_teacher:  # stand-in cache columns (their values do not matter here)
    B, L = batch["inputs_BxL"].shape
    batch["teacher_topk_ids_BxLxK"] = np.zeros((B, L, 3), np.int32)
    batch["teacher_topk_logprobs_BxLxK"] = np.full((B, L, 3), -2.0, np.float32)
  calls = []
  original = Transformer.__call__

  def spy(self, tokens, **kw):
    calls.append((self is teacher, kw.get("return_hidden_states"), kw.get("return_attention")))
    return original(self, tokens, **kw)

  extras = {"teacher": teacher} if extras_teacher else {}
  with mock.patch.object(Transformer, "__call__", spy):  # tracing is enough: flags are static
    jax.eval_shape(lambda: make_distill_objective(strategy)(student, extras, h.to_jnp(batch), None))
  return sorted(calls)


def test_models_are_asked_only_for_what_the_strategy_reads():
  assert _recorded_flags(LogitKD()) == [(False, False, False), (True, False, False)]
  assert _recorded_flags(AttentionTransfer({0: 0})) == [(False, False, True), (True, False, True)]
  assert _recorded_flags(FeaturePooling({0: 0})) == [(False, True, False), (True, True, False)]
  # An offline-cache strategy never runs a teacher (none needs to be loaded).
  assert _recorded_flags(CachedLogitKD(), extras_teacher=False) == [(False, False, False)]


def test_missing_teacher_and_vocab_mismatch_raise():
  student, teacher, batch = setup(LogitKD())
  with pytest.raises(ConfigError, match="no frozen model named 'teacher'"):
    jax.eval_shape(lambda: make_distill_objective(LogitKD())(student, {}, h.to_jnp(batch), None))
  # A teacher narrower than the student (a wider one is a padded table, cut to the student's:
  # test_multi_teacher's padded-teacher test).
  other = random_model(h.TEACHER_CONFIG.replace(vocab_size=h.VOCAB - 2), 0, NORMS_NEAR_ONE)
  with pytest.raises(ConfigError, match="wider than the teacher's"):
    jax.eval_shape(lambda: make_distill_objective(LogitKD())(student, {"teacher": other},
                                                             h.to_jnp(batch), None))
  with pytest.raises(ConfigError, match="chunk_size"):
    make_distill_objective(LogitKD(), chunk_size=0)


def test_distill_student_export_is_the_bare_model():
  student, _, _ = setup()
  exported = nnx.to_pure_dict(nnx.state(student.model))
  assert "projections" not in exported and "model" not in exported
  assert set(nnx.to_pure_dict(nnx.state(student))) == {"model", "projections"}
  with pytest.raises(ConfigError, match="teacher_embed_dim"):
    DistillStudent(student.model, FeatureProjection({0: 0}))
