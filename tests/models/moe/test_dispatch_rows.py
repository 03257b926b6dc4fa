"""dispatch_rows.gather_rows against jnp.take, the unchanged path: the same rows, and the same
gradients, which it forms by gathering through the inverse permutation rather than by
scatter-adding (test_dispatch_layout.py checks the compiled TPU step has no such scatter)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.models.moe.dispatch_rows import gather_rows


@pytest.mark.parametrize("k,dtype,tol", [(1, jnp.float32, 1e-6), (4, jnp.float32, 1e-6),
                                         (3, jnp.bfloat16, 2e-2)])
def test_rows_and_gradients_equal_jnp_take(k, dtype, tol):
  T, D, E = 37, 8, 5
  keys = jax.random.split(jax.random.key(0), 4)
  x_TxD = jax.random.normal(keys[0], (T, D)).astype(dtype)
  experts_N = jax.random.randint(keys[1], (k * T,), 0, E)  # slot-major assignments
  order_N = jnp.argsort(experts_N, stable=True)
  inverse_N = jnp.argsort(order_N)
  w_NxD = jax.random.normal(keys[2], (k * T, D)).astype(dtype)

  def through(take):
    """Rows into expert order, a per-row product, back to assignment order, summed per token
    with weights: the dispatch's shape of use."""
    def loss(x):
      sorted_NxD = take(x, order_N, inverse_N, "in") * w_NxD
      back_KxTxD = take(sorted_NxD, inverse_N, order_N, "out").reshape(k, T, D)
      return jnp.sum((back_KxTxD.astype(jnp.float32) * jnp.arange(1, k + 1)[:, None, None]) ** 2)
    return jax.value_and_grad(loss)

  ours = through(lambda x, order, inverse, _: gather_rows(x, order, inverse))
  plain = through(lambda x, order, inverse, way: jnp.take(
      x, order % T if way == "in" else order, axis=0))
  (loss, grad), (loss0, grad0) = ours(x_TxD), plain(x_TxD)
  np.testing.assert_allclose(loss, loss0, rtol=tol)
  scale = float(jnp.max(jnp.abs(grad0.astype(jnp.float32))))
  np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(grad0, np.float32),
                             atol=tol * scale, rtol=0)
  assert grad.dtype == dtype


def test_vmap_and_jit_carry_it():
  T, D, k = 6, 3, 2
  order_N = jnp.array([3, 0, 7, 1, 11, 5, 2, 9, 4, 10, 6, 8])
  inverse_N = jnp.argsort(order_N)
  x_BxTxD = jax.random.normal(jax.random.key(1), (2, T, D))
  grad = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(gather_rows(x, order_N, inverse_N)
                                                      * jnp.arange(k * T)[:, None]))))
  # Token t's rows are assignments t and t + T: its gradient is the sum of their positions'
  # weights, the sorted positions inverse[t] and inverse[t + T] (hand-read).
  want_T = np.asarray(inverse_N[:T] + inverse_N[T:], np.float32)
  np.testing.assert_allclose(grad(x_BxTxD), np.broadcast_to(want_T[None, :, None], (2, T, D)))
