"""Training steps of a tiny float32 MoE student with the kernel its platform picks by default
(model.moe_impl='ragged': the TPU's own ragged_dot there), against the dense reference experts
on the CPU: each step's loss, gradient norm and every gradient.

The reference trains three plain-SGD steps on the CPU; the default kernel computes the loss and
gradients at each of the states the reference passes through (the same steps' states), so the
comparison measures each step's error, not the tiny model's sensitivity to it: run free, the
two trajectories' third gradient norms drift apart 50-fold from a 1e-4 difference in the first
(measured on a v5e, benchmarks/results/tpu/chip_tests_call2.json). Dropless routing, and capacity
drops (rows past the groups' total, which a TPU leaves undefined: before they were masked, the
x gradient was NaN in bf16 there).

On the CPU suite both run on the CPU: the grouped matmul against the dense experts through a
whole model and its backward. In the chip run (scripts/chip_tests.sh, JAX_PLATFORMS=tpu,cpu)
the default kernel runs on the TPU and the reference on the host's CPU, in one process.

Tolerances: on the CPU the two dispatches sum the same products in another order: gradients
~1.5e-6 apart relative to each array's largest entry, losses ~1e-7 (measured): 1e-5 and 1e-6.
On a TPU, float32 under precision 'highest' (tests/support/chip.py: six bf16 passes, the TPU's
exp and log, splash attention) left the first gradient norm 8.5e-5 apart (measured): 5e-3 per
gradient array (scaled by its largest entry), 1e-3 for the norms, 1e-4 for the losses. The
experts' input gradient 12% off (a v5e before the masking) fails them many times over.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from distillax.models.presets import get_preset
from distillax.trainers import lm_objective
from tests.framework.test_chunked_loss import _batch
from tests.support import chip
from tests.support.models import NORMS_NEAR_ONE, random_model

STEPS = 3
LR = 1e-2


def _loss_and_grads_fn(config, device):
  """A jitted (params -> mean loss, gradients) of `config` with its data on `device`, and the
  model's initial params there."""
  with jax.default_device(device):
    graphdef, params = nnx.split(random_model(config, seed=3, init=NORMS_NEAR_ONE))
    batch = _batch(B=4, L=16, vocab=config.vocab_size, seed=5)

  def mean_loss(p):
    out = lm_objective(nnx.merge(graphdef, p), {}, batch, jax.random.key(0))
    return out.loss_sum / out.tokens
  return jax.jit(jax.value_and_grad(mean_loss)), params


def _reference_states(config):
  """The dense experts' SGD trajectory on the CPU: each step's params, loss and gradients."""
  cpu = jax.devices("cpu")[0]
  loss_and_grads, params = _loss_and_grads_fn(config.replace(moe_impl="dense"), cpu)
  tx = optax.sgd(LR)
  opt_state = tx.init(params)
  states = []
  for _ in range(STEPS):
    loss, grads = loss_and_grads(params)
    states.append((params, float(loss), grads))
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return states


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_default_kernel_steps_equal_the_dense_reference_on_the_cpu(capacity_factor):
  config = get_preset("tiny_moe", dtype="float32", param_dtype="float32",
                      moe_capacity_factor=capacity_factor)
  assert config.moe_impl == "ragged"  # the default every platform runs
  device = jax.devices()[0]
  loss_and_grads, _ = _loss_and_grads_fn(config, device)
  states = _reference_states(config)
  assert states[-1][1] < states[0][1]  # the steps learn
  loss_tol, norm_tol, grad_tol = (1e-4, 1e-3, 5e-3) if chip.on_tpu() else (1e-6, 1e-5, 1e-5)
  for step, (params, want_loss, want_grads) in enumerate(states):
    loss, grads = loss_and_grads(jax.device_put(params, device))
    np.testing.assert_allclose(float(loss), want_loss, rtol=loss_tol, err_msg=f"step {step}")
    np.testing.assert_allclose(float(optax.tree.norm(grads)), float(optax.tree.norm(want_grads)),
                               rtol=norm_tol, err_msg=f"step {step}: gradient norm")
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(want_grads),
                                 jax.tree.leaves(grads), strict=True):
      chip.assert_scaled(np.asarray(got), np.asarray(want), grad_tol,
                         f"step {step}: {jax.tree_util.keystr(path)}")
