"""A few float32 training steps of a tiny MoE student with the kernel its platform picks by
default (model.moe_impl='ragged': the TPU's own ragged_dot there), against the same steps with
the dense reference experts on the CPU: every step's loss and gradient norm.

On the CPU suite both run on the CPU: the grouped matmul against the dense experts through a
whole model, its optimizer and several steps. In the chip run (scripts/chip_tests.sh, with
JAX_PLATFORMS=tpu,cpu) the default kernel runs on the TPU and the reference on the host's CPU,
in one process: what a user training an MoE student on a TPU gets, next to the CPU's numbers.
Dropless routing, and capacity drops (rows past the groups' total, which a TPU leaves
undefined: before they were masked, the x gradient was NaN in bf16 there).

Tolerances: the two dispatches sum the same products in another order, so their first
gradients differ by ~1e-6 relative (measured on CPU, leaf by leaf); after an SGD step the losses
agree to 1e-7 and the gradient norms, which fall from 23 to 5 over the three steps (sums of
squares that cancel), to 6e-5 at most (measured): 1e-6 and 2e-4 on the CPU. On a TPU, float32
under precision 'highest' (tests/support/chip.py: six bf16 passes, the TPU's exp and log) adds
a few ulp per op: 1e-4 and 1e-3. A wrong input gradient of the experts (12% off on a v5e before
the rows past the groups were masked) moves the gradient norms by far more.
"""

import jax
import jax.numpy as jnp
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


def _steps(config, device):
  """(loss, gradient norm) of each of STEPS plain-SGD steps, everything on `device`."""
  with jax.default_device(device):
    model = random_model(config, seed=3, init=NORMS_NEAR_ONE)
    graphdef, params = nnx.split(model)
    batch = _batch(B=4, L=16, vocab=config.vocab_size, seed=5)
    tx = optax.sgd(LR)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
      def mean_loss(p):
        out = lm_objective(nnx.merge(graphdef, p), {}, batch, jax.random.key(0))
        return out.loss_sum / out.tokens
      loss, grads = jax.value_and_grad(mean_loss)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    rows = []
    for _ in range(STEPS):
      params, opt_state, loss, norm = step(params, opt_state)
      rows.append((float(loss), float(norm)))
  return np.asarray(rows)


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_default_kernel_trains_as_the_dense_reference_on_the_cpu(capacity_factor):
  config = get_preset("tiny_moe", dtype="float32", param_dtype="float32",
                      moe_capacity_factor=capacity_factor)
  assert config.moe_impl == "ragged"  # the default every platform runs
  got = _steps(config, jax.devices()[0])
  want = _steps(config.replace(moe_impl="dense"), jax.devices("cpu")[0])
  assert np.all(np.isfinite(got)), got
  assert want[-1, 0] < want[0, 0]  # the steps learn
  loss_tol, norm_tol = (1e-4, 1e-3) if chip.on_tpu() else (1e-6, 2e-4)
  np.testing.assert_allclose(got[:, 0], want[:, 0], rtol=loss_tol, err_msg="losses")
  np.testing.assert_allclose(got[:, 1], want[:, 1], rtol=norm_tol, err_msg="gradient norms")
