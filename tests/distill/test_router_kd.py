"""Router distillation (RouterKD): zero for the teacher itself, a numpy KL over the kept experts
of mapped layers, a gradient that reaches the student's routers only, and the one-line refusal
of a student whose experts are not the teacher's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.distill import RouterKD, make_distill_objective
from distillax.errors import ConfigError
from distillax.main import main
from distillax.models.presets import get_preset
from tests.support.engines import packed_batches
from tests.support.models import Normal, random_model
from tests.test_main import ROOT

BATCH = {k: jnp.asarray(v) for k, v in packed_batches(1, batch=2, seq_len=8)[0].items()}
TEACHER = random_model(get_preset("tiny_moe"), seed=1, init=Normal(0.3))
KEPT = ((3, 0, 2), (1, 2, 3))  # student layer 0 is teacher layer 1, student layer 1 layer 0


def _run(strategy, student, teacher):
  """(objective output, d loss / d student params, both models' router logits)."""
  s_def, s_state = nnx.split(student)
  t_def, t_state = nnx.split(teacher)

  @jax.jit
  def run(s_state, t_state):
    t = nnx.merge(t_def, t_state)

    def loss(s_state):
      out = make_distill_objective(strategy)(nnx.merge(s_def, s_state), {"teacher": t}, BATCH,
                                             jax.random.key(0))
      return out.loss_sum, out

    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(s_state)
    logits = [m(BATCH["inputs_BxL"], segment_ids_BxL=BATCH["segment_ids_BxL"],
                positions_BxL=BATCH["positions_BxL"], return_router_logits=True
                ).router_logits_NxBxLxE for m in (nnx.merge(s_def, s_state), t)]
    return out, grads, logits

  return run(s_state, t_state)


def test_router_kd_is_zero_for_the_teacher_itself():
  graphdef, state = nnx.split(TEACHER)
  objective = make_distill_objective(RouterKD())

  @jax.jit
  def run(state):
    model = nnx.merge(graphdef, state)
    return objective(model, {"teacher": model}, BATCH, jax.random.key(0))

  out = run(state)
  assert abs(float(out.sums["router_kd"])) < 1e-5 and float(out.tokens) > 0


def _log_softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_router_kd_is_the_numpy_kl_over_kept_experts_and_trains_the_routers_only():
  student = random_model(get_preset("tiny_moe", num_experts=3), seed=2, init=Normal(0.3))
  strategy = RouterKD(layer_map={0: 1, 1: 0}, experts=KEPT)
  out, grads, (s_logits, t_logits) = _run(strategy, student, TEACHER)
  s_logits, t_logits = np.asarray(s_logits, np.float64), np.asarray(t_logits, np.float64)
  mask = np.asarray(BATCH["loss_mask_BxL"]) > 0
  kl = 0.0
  for s, t in ((0, 1), (1, 0)):
    log_p = _log_softmax(t_logits[t][..., list(KEPT[s])])
    log_q = _log_softmax(s_logits[s])
    kl = kl + np.sum(np.exp(log_p) * (log_p - log_q), axis=-1) / 2
  want = float(np.sum(kl[mask]))
  assert want > 0.01
  np.testing.assert_allclose(float(out.sums["router_kd"]), want, rtol=1e-5)
  np.testing.assert_allclose(float(out.loss_sum), want, rtol=1e-5)  # the only term, weight 1
  flat = {jax.tree_util.keystr(p): np.asarray(g)
          for p, g in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0]}
  routers = [k for k in flat if k.endswith("['mlp']['router']")]
  assert len(routers) == 2 and all(np.abs(flat[k]).max() > 0 for k in routers)
  assert all(not np.any(g) for k, g in flat.items() if k not in routers), [
      k for k, g in flat.items() if k not in routers and np.any(g)]


def test_router_kd_refuses_experts_that_do_not_correspond():
  with pytest.raises(ConfigError, match="the student's 3 experts per layer are not the teacher's "
                                        "4 and no kept-expert map says which they are"):
    RouterKD().check_experts(2, 3, 2, 4)
  with pytest.raises(ConfigError, match=r"student layer 1 has 3 experts but the kept-expert map "
                                        r"gives \[1, 2\] of the teacher's 4"):
    RouterKD(experts=((0, 1, 2), (1, 2))).check_experts(2, 3, 2, 4)
  with pytest.raises(ConfigError, match="the teacher is dense"):
    RouterKD().check_experts(2, 4, 2, 0)


def test_router_distillation_from_the_config_refuses_a_student_with_other_experts(capsys,
                                                                                 tmp_path):
  code = main(["distillax", "train", "--config", f"{ROOT}/distillax/configs/distill.py:tiny",
               "--workdir", str(tmp_path / "run"), "--config.teacher.preset=tiny_moe",
               "--config.model.num_layers=2", "--config.model.num_experts=3",
               "--config.distill.router.weight=1"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1, err
  assert err[0].endswith("the student's 3 experts per layer are not the teacher's 4 and no "
                         "kept-expert map says which they are; derive the student from the "
                         "teacher's blocks (student.from_teacher.layers, and "
                         "student.from_teacher.experts for a subset) or set "
                         "distill.router.weight=0"), err
  assert not (tmp_path / "run").exists()
