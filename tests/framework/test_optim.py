"""Optimizer from config: schedules follow their formulas, weight decay skips masked params."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.errors import ConfigError
from distillax.framework import optim


def _cfg(**kw):
  c = optim.default_optimizer_config()
  for k, v in kw.items():
    c[k] = v
  return c


def test_warmup_cosine_schedule_matches_its_formula():
  sched = optim.make_schedule(_cfg(learning_rate=1.0, warmup_steps=10, end_lr_fraction=0.1), 110)
  for step in (0, 5, 10):
    assert float(sched(step)) == pytest.approx(step / 10)
  for step in (10, 35, 60, 110):
    t = (step - 10) / 100
    assert float(sched(step)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * t)), abs=1e-6)


def test_warmup_linear_and_constant_schedules():
  lin = optim.make_schedule(_cfg(learning_rate=2.0, schedule="warmup_linear", warmup_steps=4,
                                 end_lr_fraction=0.0), 12)
  assert [round(float(lin(s)), 6) for s in (0, 2, 4, 8, 12)] == [0.0, 1.0, 2.0, 1.0, 0.0]
  const = optim.make_schedule(_cfg(learning_rate=0.5, schedule="constant", warmup_steps=0), 10)
  assert float(const(0)) == float(const(9)) == 0.5
  with pytest.raises(ConfigError, match="schedule='exp'"):
    optim.make_schedule(_cfg(schedule="exp"), 10)
  with pytest.raises(ConfigError, match="warmup_steps=20 must be smaller"):
    optim.make_schedule(_cfg(warmup_steps=20), 10)


def test_weight_decay_is_masked_off_norms_biases_and_embeddings():
  params = {"embedder": {"embedding": jnp.ones((4, 2))}, "layers": {"0": {
      "attn_norm": {"scale": jnp.ones((2,))}, "mlp": {"up": jnp.ones((2, 3)),
                                                       "bias": jnp.ones((3,))}}}}
  mask = optim.decay_mask(params, optim.default_optimizer_config().no_decay)
  assert mask["layers"]["0"]["mlp"]["up"] is True
  assert not mask["embedder"]["embedding"] and not mask["layers"]["0"]["attn_norm"]["scale"]
  assert not mask["layers"]["0"]["mlp"]["bias"]
  # One AdamW step with zero gradients: only decayed weights shrink, by lr * wd exactly.
  tx, _ = optim.make_optimizer(_cfg(learning_rate=0.1, schedule="constant", warmup_steps=0,
                                    weight_decay=0.5, grad_clip_norm=0.0), 10, params)
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, state, params)
  new = jax.tree.map(lambda p, u: p + u, params, updates)
  np.testing.assert_allclose(new["layers"]["0"]["mlp"]["up"], 1 - 0.1 * 0.5)
  np.testing.assert_array_equal(new["embedder"]["embedding"], 1.0)
  np.testing.assert_array_equal(new["layers"]["0"]["attn_norm"]["scale"], 1.0)


def test_global_norm_clipping_caps_the_update_direction():
  params = {"w": jnp.zeros((3,))}
  tx, _ = optim.make_optimizer(_cfg(learning_rate=1.0, schedule="constant", warmup_steps=0,
                                    weight_decay=0.0, grad_clip_norm=1.0, b1=0.0, b2=0.0,
                                    eps=0.0), 10, params)
  grads = {"w": jnp.array([30.0, 40.0, 0.0])}  # norm 50 -> clipped to norm 1
  clipped = tx.update(grads, tx.init(params), params)[0]
  # With b1=b2=0 Adam's update is sign(g) where g != 0: clipping keeps the direction.
  np.testing.assert_allclose(clipped["w"][:2], [-1.0, -1.0], atol=1e-6)


def test_bf16_moments_follow_adamw_and_store_half_the_bytes():
  """optimizer.state_dtype='bfloat16': the moments are stored in bfloat16 and the updates follow
  optax.adamw's (float32 moments) to the moments' rounding, over steps with weight decay and a
  warmup; 'float32' is optax.adamw itself."""
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
            "norm": {"scale": jnp.ones((8,), jnp.float32)}}
  cfg = dict(learning_rate=0.05, warmup_steps=2, weight_decay=0.1, grad_clip_norm=1.0)
  tx32, _ = optim.make_optimizer(_cfg(**cfg), 10, params)
  tx16, _ = optim.make_optimizer(_cfg(state_dtype="bfloat16", **cfg), 10, params)
  s32, s16 = tx32.init(params), tx16.init(params)
  leaves = lambda s: [x for x in jax.tree.leaves(s) if x.ndim]
  assert {x.dtype for x in leaves(s16)} == {jnp.dtype(jnp.bfloat16)}
  assert sum(x.nbytes for x in leaves(s16)) * 2 == sum(x.nbytes for x in leaves(s32))
  for step in range(5):
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    u32, s32 = tx32.update(grads, s32, params)
    u16, s16 = tx16.update(grads, s16, params)
    for a, b in zip(jax.tree.leaves(u16), jax.tree.leaves(u32)):
      # Adam's update is m / sqrt(v), each moment rounded to 2^-9: ~3e-3 relative at most.
      np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-4, err_msg=f"step {step}")
    params = jax.tree.map(lambda p, u: p + u, params, u32)
  with pytest.raises(ConfigError, match=r"optimizer.state_dtype='float16'; choose one of "
                                        r"float32, bfloat16"):
    optim.make_optimizer(_cfg(state_dtype="float16"), 10, params)
