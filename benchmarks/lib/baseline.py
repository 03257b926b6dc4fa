"""A hand-written minimal flax + optax train step: the yardstick of the framework's overhead.

What a user would write without distillax for the same model, loss and optimizer: one
`jax.jit`-ed function of (params, opt_state, batch) on one device, the model's own forward, the
masked mean cross-entropy, `optax.chain(clip_by_global_norm, adamw)` with the same
hyperparameters, schedule and weight-decay mask as the framework's optimizer config, buffers
donated. No sharding rules, no metrics beyond the loss, no state dataclass.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from distillax.framework import optim


class MinimalStep:
  """Callable like `common.Stepper`: `step(n)` runs n steps and blocks."""

  def __init__(self, model: nnx.Module, optimizer_cfg, total_steps: int,
               batch: Mapping[str, np.ndarray]):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    schedule = optim.make_schedule(optimizer_cfg, total_steps)
    mask = optim.decay_mask(params, optimizer_cfg.no_decay)
    tx = optax.chain(
        optax.clip_by_global_norm(optimizer_cfg.grad_clip_norm),
        optax.adamw(schedule, b1=optimizer_cfg.b1, b2=optimizer_cfg.b2, eps=optimizer_cfg.eps,
                    weight_decay=optimizer_cfg.weight_decay, mask=mask))

    def loss_fn(p, rest, batch):
      m = nnx.merge(graphdef, p, rest)
      logits = m(batch["inputs_BxL"], positions_BxL=batch["positions_BxL"],
                 segment_ids_BxL=batch["segment_ids_BxL"]).logits_BxLxV
      logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      nll = -jnp.take_along_axis(logp, batch["targets_BxL"][..., None], axis=-1)[..., 0]
      mask_ = batch["loss_mask_BxL"]
      return jnp.sum(nll * mask_) / jnp.maximum(jnp.sum(mask_), 1.0)

    def train_step(p, opt_state, rest, batch):
      loss, grads = jax.value_and_grad(loss_fn)(p, rest, batch)
      updates, opt_state = tx.update(grads, opt_state, p)
      return optax.apply_updates(p, updates), opt_state, loss

    self._step = jax.jit(train_step, donate_argnums=(0, 1))
    self.params, self.rest = params, rest
    self.opt_state = jax.jit(tx.init)(params)
    self.batch = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()})
    self.losses: list[float] = []

  def __call__(self, steps: int) -> None:
    p, o, loss = self.params, self.opt_state, None
    for _ in range(steps):
      p, o, loss = self._step(p, o, self.rest, self.batch)
    jax.block_until_ready((p, o, loss))
    self.params, self.opt_state = p, o
    self.losses.append(float(loss))
