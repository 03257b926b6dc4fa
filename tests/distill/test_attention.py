"""AttentionTransfer (distill/attention.py) against numpy: head grouping, KL and MSE."""

import numpy as np
import pytest

from distillax.distill import AttentionTransfer, DistillInputs
from tests.distill import helpers as h
from tests.distill.helpers import make_inputs


@pytest.mark.parametrize("kind", ["kl", "mse"])
def test_attention_transfer_groups_heads_and_matches_numpy(kind):
  inputs, a = make_inputs(seed=1)
  layer_map = {0: 1, 1: 2}
  loss, sums = AttentionTransfer(layer_map, loss=kind, weight=0.5).loss_sums(inputs)
  ref = h.np_attention_term(kind, a["s_probs"], a["t_probs"], layer_map, a["mask"])
  np.testing.assert_allclose(float(sums["attention_transfer"]), ref, rtol=1e-5)
  np.testing.assert_allclose(float(loss), 0.5 * ref, rtol=1e-5)


def test_attention_transfer_same_heads_kl_zero_on_itself():
  inputs, a = make_inputs(seed=2, s_heads=4, t_heads=4)
  same = DistillInputs(batch=inputs.batch, student=inputs.teacher, teacher=inputs.teacher)
  term, _ = AttentionTransfer({2: 2}).term_sums(same)
  assert abs(float(term)) < 1e-6
  term, _ = AttentionTransfer({0: 2}, loss="kl").term_sums(inputs)
  ref = h.np_attention_term("kl", a["s_probs"], a["t_probs"], {0: 2}, a["mask"])
  np.testing.assert_allclose(float(term), ref, rtol=1e-5)
