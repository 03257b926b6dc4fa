"""apply_rope's two forms, split halves and whole heads (the halves swapped by a +-1 matmul, what
the attention layer runs on a TPU), against rotate_half written out in float64 numpy, and the
whole-head form against the split one: values and gradients, bf16 and fp32, under jit and vmap;
the attention layer picks the whole-head form for a TPU compile only."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.models.layers import apply_rope


def _halves_reference(x, sin, cos):
  """Llama's rotate_half in float64: (x1 cos - x2 sin, x2 cos + x1 sin) per head."""
  x = np.asarray(x, np.float64)
  s, c = np.asarray(sin, np.float64)[:, :, None, :], np.asarray(cos, np.float64)[:, :, None, :]
  x1, x2 = np.split(x, 2, axis=-1)
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _inputs(dtype, head_dim=16, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(2, 5, 3, head_dim)), dtype)
  angles = jnp.asarray(rng.uniform(-4, 4, size=(2, 5, head_dim // 2)), jnp.float32)
  return x, jnp.sin(angles), jnp.cos(angles)


@pytest.mark.parametrize("swap_on_mxu", [False, True])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_rope_equals_rotate_half_over_split_halves(dtype, tol, swap_on_mxu):
  x, sin, cos = _inputs(dtype)
  got = jax.jit(functools.partial(apply_rope, swap_on_mxu=swap_on_mxu))(x, sin, cos)
  assert got.dtype == dtype and got.shape == x.shape
  want = _halves_reference(np.asarray(x.astype(jnp.float32)), sin, cos)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


def test_rope_of_bf16_inputs_is_the_fp32_product_rounded_once():
  """The swap is exact (one +-1 term per output): the bf16 result is the float64 rotation of
  the bf16 inputs rounded to bf16, up to one rounding of fp32's products."""
  x, sin, cos = _inputs(jnp.bfloat16, head_dim=128, seed=3)
  got = np.asarray(apply_rope(x, sin, cos, swap_on_mxu=True), np.float32)
  want = _halves_reference(np.asarray(x.astype(jnp.float32)), sin, cos)
  np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 4e-3)])
def test_whole_head_rope_gradients_equal_the_split_form(dtype, tol):
  x, sin, cos = _inputs(dtype, seed=1)
  w = jnp.asarray(np.random.default_rng(2).normal(size=x.shape), jnp.float32)
  loss = lambda swap: lambda x, sin, cos: jnp.sum(
      apply_rope(x, sin, cos, swap_on_mxu=swap).astype(jnp.float32) * w)
  got = jax.grad(loss(True), argnums=(0, 1, 2))(x, sin, cos)
  want = jax.grad(loss(False), argnums=(0, 1, 2))(x, sin, cos)
  for g, r in zip(got, want):
    assert g.dtype == r.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=tol,
                               rtol=tol)


def test_whole_head_rope_under_vmap_equals_the_split_form():
  x, sin, cos = _inputs(jnp.float32, seed=4)
  one = lambda x, s, c: apply_rope(x[None], s[None], c[None], swap_on_mxu=True)[0]
  batched = jax.vmap(one)(x, sin, cos)
  np.testing.assert_allclose(np.asarray(batched), np.asarray(apply_rope(x, sin, cos)),
                             atol=1e-6)


def test_partial_whole_head_rope_keeps_the_unturned_features():
  x, sin, cos = _inputs(jnp.float32, head_dim=16, seed=6)
  sin, cos = sin[..., :4], cos[..., :4]  # 4 pairs: the first 8 of 16 features turn
  got = np.asarray(apply_rope(x, sin, cos, swap_on_mxu=True))
  np.testing.assert_allclose(got, np.asarray(apply_rope(x, sin, cos)), atol=1e-6)
  np.testing.assert_array_equal(got[..., 8:], np.asarray(x)[..., 8:])


def test_the_attention_layer_turns_whole_heads_for_a_tpu_compile_without_full_remat(
    monkeypatch):
  import distillax.models.attention.layer as attention_layer
  from distillax.models.attention import impl
  from distillax.models.presets import get_preset

  cfg = get_preset("tiny")
  monkeypatch.setattr(impl, "compile_platform", lambda: "cpu")
  assert not attention_layer._rope_on_mxu(cfg.replace(remat="save_attention"))
  monkeypatch.setattr(impl, "compile_platform", lambda: "tpu")
  assert attention_layer._rope_on_mxu(cfg.replace(remat="save_attention"))
  assert attention_layer._rope_on_mxu(cfg.replace(remat="none"))
  assert not attention_layer._rope_on_mxu(cfg.replace(remat="full"))
