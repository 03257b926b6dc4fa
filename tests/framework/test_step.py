"""Pieces of the step: the token losses it sums, micro-batch splitting and the update norm it
reports."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from distillax.framework import losses, optim
from distillax.framework.step import split_microbatches
from distillax.models.init import create_model
from tests.support.engines import mesh_and_rules, packed_batches, tiny_engine
from tests.support.models import TINY


def test_cross_entropy_sums_match_numpy():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(4, 6, 11)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 11, (4, 6)), jnp.int32)
  mask = jnp.asarray(rng.random((4, 6)) > 0.3, jnp.float32)
  loss, correct, tokens = losses.cross_entropy_sums(logits, targets, mask)
  x = np.asarray(logits, np.float64)
  lp = x - x.max(-1, keepdims=True)
  lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
  direct = -sum(lp[b, t, targets[b, t]] * mask[b, t] for b in range(4) for t in range(6))
  np.testing.assert_allclose(loss, direct, rtol=1e-5)
  assert float(tokens) == float(np.sum(mask))
  hits = np.asarray(jnp.argmax(logits, -1) == targets) * np.asarray(mask)
  assert float(correct) == float(hits.sum())


def test_microbatches_take_every_kth_row_and_cover_the_batch():
  batch = {"x": np.arange(8)[:, None] * np.ones((1, 3))}
  micro = split_microbatches(batch, 4)
  assert micro["x"].shape == (4, 2, 3)
  np.testing.assert_array_equal(micro["x"][:, :, 0], [[0, 4], [1, 5], [2, 6], [3, 7]])


def test_update_norm_is_the_norm_of_the_updates_optax_gives():
  """The step reports update_norm as the norm of the change the fp32 master weights took (so
  XLA keeps each parameter's Adam update in one pass, framework/step.py): for AdamW with
  clipping and masked decay, over parameters of a model's scale (0.02) and updates ~1e-3 of
  them, that is the norm of optax's own updates within 1e-5 relative."""
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"embed": jax.random.normal(keys[0], (512, 64)) * 0.02,
            "layer": {"w": jax.random.normal(keys[1], (64, 256)) * 0.02,
                      "norm": jnp.ones((64,))}}
  grads = jax.tree.map(lambda p, k: jax.random.normal(k, p.shape) * 0.1, params,
                       {"embed": keys[2], "layer": {"w": keys[3], "norm": keys[3]}})
  cfg = optim.default_optimizer_config()
  cfg.warmup_steps = 0
  tx, _ = optim.make_optimizer(cfg, 10, params)
  state = tx.init(params)
  for _ in range(3):  # past the first step, where Adam's update is sign(g)
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    applied = jax.tree.map(jnp.subtract, new, params)
    np.testing.assert_allclose(optax.tree.norm(applied), optax.tree.norm(updates), rtol=1e-5)
    params = new


def test_the_steps_update_norm_is_the_change_its_parameters_took():
  """Through the compiled step (8 devices, dp): update_norm equals the norm of the difference
  between the parameters before and after the step, taken on the host in float64."""
  batches = packed_batches(3)
  mesh, rules = mesh_and_rules("dp", 8)
  model = create_model(TINY, mesh=mesh, rules=rules, seed=0)
  engine = tiny_engine(model, batches[0], mesh, rules, steps=3)
  state = engine.init_state(model, {}, seed=0)
  for batch in batches:
    before = jax.device_get(engine.runner.fetch_state(state).params)
    state, metrics = engine.runner(state, engine.runner.place_batch(batch))
    after = jax.device_get(engine.runner.fetch_state(state).params)
    change = np.sqrt(sum(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
                         for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))))
    np.testing.assert_allclose(float(metrics["update_norm"]), change, rtol=1e-5)
