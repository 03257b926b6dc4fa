"""Shared pieces of the engine tests: a GQA tiny model and packed synthetic batches."""

import jax
import numpy as np

from distillax import partitioning as pt
from distillax.framework import optim
from distillax.framework.engine import build_engine
from distillax.models.config import get_preset
from distillax.models.init import create_model
from distillax.trainers import lm_objective

# 8 query heads over 4 kv heads so every preset places on meshes with model <= 4.
MODEL = get_preset("tiny", num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=128)


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
  cfg = optim.default_optimizer_config()
  cfg.learning_rate = 3e-3
  cfg.warmup_steps = 2
  return cfg


def run_training(backend, strategy, mesh_shape, batches, *, accum_steps=1, model_cfg=MODEL,
                 steps=None):
  """Losses per step and final params (host numpy) of `len(batches)` steps."""
  mesh = pt.create_mesh({"data": mesh_shape[0], "model": mesh_shape[1]})
  rules = pt.rules_from_config({"strategy": strategy})
  model = create_model(model_cfg, mesh=mesh, rules=rules, seed=0)
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batches[0].items()}
  engine = build_engine(model, {}, lm_objective, optimizer_config(), steps or len(batches), mesh,
                        rules, backend, shapes, accum_steps=accum_steps)
  state = engine.init_state(model, {}, seed=0)
  losses = []
  for b in batches:
    state, metrics = engine.runner(state, engine.runner.place_batch(process_local(b)))
    losses.append(float(metrics["loss"]))
  final = engine.runner.fetch_state(state).params
  # Across processes the sharded params are not all addressable here; single-process callers
  # compare them on the host.
  final = jax.device_get(final) if jax.process_count() == 1 else None
  return np.array(losses), final, engine
