"""A mixture-of-experts student in logit distillation: its router losses enter the objective with
the weights the recipe passes, and its expert loads are reported (dense teacher, tiny shapes)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax.distill import LogitKD, make_distill_objective
from distillax.models.moe import layer as moe
from distillax.models.presets import get_preset
from tests.support.engines import packed_batches
from tests.support.models import Normal, random_model


def test_moe_student_router_losses_enter_the_distillation_objective():
  batch = {k: jnp.asarray(v) for k, v in packed_batches(1, batch=2, seq_len=8)[0].items()}
  student = random_model(get_preset("tiny_moe"), init=Normal(0.1))
  teacher = random_model(get_preset("tiny"), seed=1, init=Normal(0.1))
  s_def, s_state = nnx.split(student)
  t_def, t_state = nnx.split(teacher)

  @jax.jit
  def run(s_state, t_state):
    s, t = nnx.merge(s_def, s_state), nnx.merge(t_def, t_state)
    outs = [make_distill_objective(LogitKD(), router_loss_weights=w)(s, {"teacher": t}, batch,
                                                                      jax.random.key(0))
            for w in ((0.0, 0.0), (0.5, 0.25))]
    stats = s(batch["inputs_BxL"], segment_ids_BxL=batch["segment_ids_BxL"],
              positions_BxL=batch["positions_BxL"], return_logits=False).router_stats
    return outs, moe.router_losses(stats)

  (plain, weighted), terms = run(s_state, t_state)
  tokens = float(plain.tokens)
  aux, z = float(jnp.mean(terms["aux_N"])), float(jnp.mean(terms["z_N"]))
  np.testing.assert_allclose(plain.sums["moe_aux_loss"], tokens * aux, rtol=1e-5)
  np.testing.assert_allclose(plain.sums["router_z_loss"], tokens * z, rtol=1e-5)
  np.testing.assert_allclose(weighted.loss_sum, plain.loss_sum + tokens * (0.5 * aux + 0.25 * z),
                             rtol=1e-5)
  assert sorted(plain.ratios) == ["expert_load_max_over_mean_l0", "expert_load_max_over_mean_l1",
                                  "expert_tokens_dropped_l0", "expert_tokens_dropped_l1"]
  assert float(plain.ratios["expert_tokens_dropped_l0"][0]) == 0.0  # dropless
