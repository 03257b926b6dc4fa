"""Optimizer and learning-rate schedule from config.

AdamW with decoupled weight decay, masked off parameters whose path matches `no_decay` (norm
scales, biases, embeddings by default: decaying them hurts small models and buys nothing), global
norm clipping, and one of three schedules. Only trainable parameters reach the optimizer, so frozen
parts (a teacher, base weights under LoRA) hold no optimizer state.

`state_dtype='bfloat16'` stores Adam's two moments in bfloat16 (computed in float32 each step,
rounded when stored): half the optimizer's memory, which is what lets the real student's fp32
master weights train at 16k tokens on one 16 GB chip. The update it gives differs from the
float32 moments' by the moments' rounding (2^-9 relative).
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from distillax.errors import ConfigError
from distillax.partitioning.shard import path_str

SCHEDULES = ("constant", "warmup_cosine", "warmup_linear")
STATE_DTYPES = ("float32", "bfloat16")


def default_optimizer_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.learning_rate = 3e-4  # peak learning rate
  c.schedule = "warmup_cosine"  # one of constant | warmup_cosine | warmup_linear
  c.warmup_steps = 10  # linear warmup from 0 to the peak
  c.end_lr_fraction = 0.1  # final lr as a fraction of the peak (cosine / linear decay)
  c.b1 = 0.9  # Adam beta1
  c.b2 = 0.95  # Adam beta2
  c.eps = 1e-8  # Adam epsilon
  c.weight_decay = 0.1  # decoupled weight decay (AdamW)
  c.no_decay = r"(norm|bias|embed)"  # regex over param paths excluded from weight decay
  c.grad_clip_norm = 1.0  # global-norm clipping; 0 disables
  c.state_dtype = "float32"  # Adam moments stored as float32 | bfloat16 (half the memory)
  return c


# (field, test, what it must be). A value outside these cannot train: a negative learning rate
# climbs the loss until rollback gives up steps later, a NaN one poisons the first update.
_LIMITS = (("learning_rate", lambda v: v > 0, "a positive number"),
           ("warmup_steps", lambda v: v >= 0, "0 or more steps"),
           ("weight_decay", lambda v: v >= 0, "0 (off) or more"),
           ("end_lr_fraction", lambda v: 0 <= v <= 1, "between 0 and 1"),
           ("b1", lambda v: 0 <= v < 1, "in [0, 1)"),
           ("b2", lambda v: 0 <= v < 1, "in [0, 1)"),
           ("eps", lambda v: v >= 0, "0 or more"),
           ("grad_clip_norm", lambda v: v >= 0, "0 (off) or more"))


def check_optimizer_config(cfg) -> None:
  """Refuses optimizer values no run can train with, in one line naming the field and a good
  value (the default), before anything is built."""
  defaults = default_optimizer_config()
  for key, ok, must in _LIMITS:
    value = cfg.get(key, defaults[key])
    if not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value)):
      raise ConfigError(f"optimizer.{key}={value!r} must be {must}, e.g. "
                        f"--config.optimizer.{key}={defaults[key]!r}")
  state_dtype = cfg.get("state_dtype", defaults.state_dtype)
  if state_dtype not in STATE_DTYPES:
    raise ConfigError(f"optimizer.state_dtype={state_dtype!r}; choose one of "
                      f"{', '.join(STATE_DTYPES)}")


def make_schedule(cfg, total_steps: int) -> optax.Schedule:
  peak = float(cfg.learning_rate)
  warmup = int(cfg.get("warmup_steps", 0))
  end = peak * float(cfg.get("end_lr_fraction", 0.0))
  kind = cfg.get("schedule", "constant")
  if kind not in SCHEDULES:
    raise ConfigError(f"optimizer.schedule={kind!r} is unknown; use one of {', '.join(SCHEDULES)}")
  if kind == "constant":
    return optax.constant_schedule(peak) if warmup == 0 else optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup])
  if warmup >= total_steps:
    raise ConfigError(f"optimizer.warmup_steps={warmup} must be smaller than train.steps="
                      f"{total_steps}; lower the warmup or raise the steps")
  if kind == "warmup_cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total_steps, end)
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup),
                               optax.linear_schedule(peak, end, total_steps - warmup)], [warmup])


def decay_mask(params: Any, no_decay: str) -> Any:
  """True where weight decay applies: every param whose path does not match `no_decay`."""
  pattern = re.compile(no_decay) if no_decay else None
  return jax.tree_util.tree_map_with_path(
      lambda p, _: not (pattern and pattern.search(path_str(p))), params)


def make_optimizer(cfg, total_steps: int, params: Any = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(transformation, schedule). `params` (arrays or shapes) fixes the weight-decay mask."""
  check_optimizer_config(cfg)
  schedule = make_schedule(cfg, total_steps)
  mask = (lambda p: decay_mask(p, cfg.get("no_decay", ""))) if params is None else decay_mask(
      params, cfg.get("no_decay", ""))
  parts = []
  if float(cfg.get("grad_clip_norm", 0.0)) > 0:
    parts.append(optax.clip_by_global_norm(float(cfg.grad_clip_norm)))
  b1, b2, eps = float(cfg.b1), float(cfg.b2), float(cfg.eps)
  if cfg.get("state_dtype", "float32") == "bfloat16":
    parts += [scale_by_adam_stored_in(jnp.bfloat16, b1, b2, eps),
              optax.add_decayed_weights(float(cfg.weight_decay), mask),
              optax.scale_by_learning_rate(schedule)]  # optax.adamw's chain, moments in bf16
  else:
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps,
                             weight_decay=float(cfg.weight_decay), mask=mask))
  return optax.chain(*parts), schedule


def scale_by_adam_stored_in(dtype, b1: float, b2: float, eps: float
                            ) -> optax.GradientTransformation:
  """optax.scale_by_adam with both moments stored in `dtype` (optax's mu_dtype covers the first
  only): each step reads them to float32, updates and bias-corrects there, and stores them
  rounded. The state is optax's ScaleByAdamState, so checkpoints and the optimizer-state
  shardings (mirrored from the parameters) treat it as they treat Adam's."""
  f32 = jnp.float32

  def init(params):
    zeros = lambda p: jnp.zeros(p.shape, dtype)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                  mu=jax.tree.map(zeros, params), nu=jax.tree.map(zeros, params))

  def update(updates, state, params=None):
    del params
    count = optax.safe_int32_increment(state.count)
    mu = jax.tree.map(lambda g, m: b1 * m.astype(f32) + (1 - b1) * g.astype(f32),
                      updates, state.mu)
    nu = jax.tree.map(lambda g, v: b2 * v.astype(f32) + (1 - b2) * jnp.square(g.astype(f32)),
                      updates, state.nu)
    mu_scale = 1 / (1 - b1 ** count.astype(f32))
    nu_scale = 1 / (1 - b2 ** count.astype(f32))
    new_updates = jax.tree.map(
        lambda g, m, v: (m * mu_scale / (jnp.sqrt(v * nu_scale) + eps)).astype(g.dtype),
        updates, mu, nu)
    store = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
    return new_updates, optax.ScaleByAdamState(count=count, mu=store(mu), nu=store(nu))

  return optax.GradientTransformation(init, update)
