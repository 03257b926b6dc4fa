"""Tiny engines for the tests that run the real compiled step: packed synthetic batches, the
tests' optimizer, one way to build an engine over them and one loop to run it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax import partitioning as pt
from distillax.framework import optim
from distillax.framework.engine import build_engine
from distillax.models.init import create_model
from distillax.trainers import lm_objective
from tests.support.models import TINY


def packed_batches(n: int, batch: int = 8, seq_len: int = 16, vocab: int = 128, seed: int = 0):
  """Rows holding two documents each plus a padded tail: segments, positions, loss mask."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    inputs = rng.integers(1, vocab, (batch, seq_len)).astype(np.int32)
    targets = rng.integers(1, vocab, (batch, seq_len)).astype(np.int32)
    seg = np.zeros((batch, seq_len), np.int32)
    pos = np.zeros((batch, seq_len), np.int32)
    for b in range(batch):
      cut, end = rng.integers(2, seq_len // 2), rng.integers(seq_len - 4, seq_len + 1)
      seg[b, :cut], seg[b, cut:end] = 1, 2
      pos[b, :cut], pos[b, cut:end] = np.arange(cut), np.arange(end - cut)
    out.append({"inputs_BxL": inputs, "targets_BxL": targets, "segment_ids_BxL": seg,
                "positions_BxL": pos, "loss_mask_BxL": (seg > 0).astype(np.float32)})
  return out


def process_local(batch):
  """This process's contiguous share of a global batch (all of it in a single process)."""
  n, i = jax.process_count(), jax.process_index()
  return {k: v[i * (len(v) // n):(i + 1) * (len(v) // n)] for k, v in batch.items()}


def optimizer_config():
  """The default optimizer at a rate a few steps of a tiny model visibly learn from."""
  cfg = optim.default_optimizer_config()
  cfg.learning_rate = 3e-3
  cfg.warmup_steps = 2
  return cfg


def mesh_and_rules(strategy: str, data: int, model: int = 1, devices=None):
  """A data x model mesh (over `devices`, default all) and `strategy`'s rule set."""
  mesh = pt.create_mesh({"data": data, "model": model}, devices=devices)
  return mesh, pt.rules_from_config({"strategy": strategy})


def batch_shapes(batch) -> dict:
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}


def tiny_engine(model, batch, mesh, rules, backend: str = "jit", *, steps: int = 10,
                objective=lm_objective, extras=None, opt=None, **options):
  """build_engine over batches shaped like `batch`: next-token loss and the tests' optimizer
  unless told otherwise; `options` are build_engine's keywords (accum_steps, trainable, ...)."""
  opt = optimizer_config() if opt is None else opt
  return build_engine(model, extras or {}, objective, opt, steps, mesh, rules, backend,
                      batch_shapes(batch), **options)


def run_steps(engine, state, batches):
  """(state, losses) after one step per batch (each cut to this process's share)."""
  losses = []
  for b in batches:
    state, metrics = engine.runner(state, engine.runner.place_batch(process_local(b)))
    losses.append(metrics["loss"])
  return state, np.array([float(x) for x in losses])


def run_training(backend, strategy, mesh_shape, batches, *, accum_steps=1, model_cfg=TINY,
                 steps=None):
  """Losses per step and final params (host numpy) of `len(batches)` steps from a fresh model."""
  mesh, rules = mesh_and_rules(strategy, *mesh_shape)
  model = create_model(model_cfg, mesh=mesh, rules=rules, seed=0)
  engine = tiny_engine(model, batches[0], mesh, rules, backend, steps=steps or len(batches),
                       accum_steps=accum_steps)
  state, losses = run_steps(engine, engine.init_state(model, {}, seed=0), batches)
  final = engine.runner.fetch_state(state).params
  # Across processes the sharded params are not all addressable here; single-process callers
  # compare them on the host.
  final = jax.device_get(final) if jax.process_count() == 1 else None
  return losses, final, engine


def train_copy(backend, model, mesh, rules, batches):
  """Losses and final params of one run from a copy of `model` (the step donates its state)."""
  graphdef, weights = nnx.split(model)
  model = nnx.merge(graphdef, jax.tree.map(jnp.copy, weights))
  engine = tiny_engine(model, batches[0], mesh, rules, backend, steps=len(batches))
  state, losses = run_steps(engine, engine.init_state(model, {}, seed=0), batches)
  return losses, jax.device_get(engine.runner.fetch_state(state).params)


def lm_loss(model, batch):
  """Mean next-token loss of `batch` (a float32 scalar) by calling the model directly, not
  through an engine; compiled once per GraphDef."""
  graphdef, state = nnx.split(model)
  return _lm_loss(graphdef, state, {k: np.asarray(v) for k, v in batch.items()})


@functools.partial(jax.jit, static_argnums=0)
def _lm_loss(graphdef, state, batch):
  out = lm_objective(nnx.merge(graphdef, state), {}, batch, None)
  return out.loss_sum / out.tokens

