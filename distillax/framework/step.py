"""The one train step: `(state, batch) -> (state, metrics)`, pure and backend-agnostic.

Objectives return *sums* over tokens (`ObjectiveOutput`), never means. The step adds them over
micro-batches (gradient accumulation is a `lax.scan` inside the step), then over data-parallel
workers, and divides by the global count of real tokens once at the end. That single rule makes
every backend, every partitioning preset and every accumulation setting compute the same numbers.

The only backend-specific part is `axis_name`: `None` where GSPMD inserts the collectives (`jit`
with parameters sharded over the data axis), the data axis where each data-parallel worker runs
the body on its own rows (`shard_map`, `pmap`, `vmap`, and `jit` with parameters replicated over
data): there gradients, losses and token counts are `psum`-reduced explicitly, once per step,
after the micro-batches and every use of a shared weight have been summed locally.

Random draws (dropout) depend on the data-parallel layout: each worker folds its index into the
step's key, and each micro-batch its number. An objective whose draws must not depend on the
layout (on-policy sampling keys each row by its global row id) is built with
`Objective(fn, rng_per_worker=False)`: every worker then gets the step's key unchanged. The flag
lives on the frozen `Objective` with its function, and a wrapper replaces the function only
(`objective.wrapped(...)`), so no wrapper can drop it.

Work done once per step on the whole batch (on-policy sampling: every completion of the step
drawn at once, from the step's weights, by one decode) is the objective's `prepare`: it runs
before the micro-batch split, outside the gradient, with the step's key, and returns arrays
added to the batch (leading dimension: rows the micro-batches split). It runs before any
micro-batch's activations exist, so the compiler can give its memory (a KV cache) to them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from distillax import partitioning as pt
from distillax.framework.state import ModelDefs, TrainState, master_dtype_params

Batch = Mapping[str, jax.Array]


@flax.struct.dataclass
class ObjectiveOutput:
  loss_sum: jax.Array  # sum of the per-token loss over real tokens of this (micro-)batch
  tokens: jax.Array  # number of real (non-padding) tokens that went into loss_sum
  sums: dict[str, jax.Array]  # per-token metric sums, reported divided by global tokens
  # Means over counts other than `tokens` (e.g. per sampled sequence): {name: (numerator sum,
  # denominator sum)}, reported as the global numerator over the global denominator (0 where
  # that is 0). Train steps report them; eval steps do not.
  ratios: dict[str, tuple[jax.Array, jax.Array]] = flax.struct.field(default_factory=dict)


# (trainable model, frozen extras by name, batch, rng) -> ObjectiveOutput
ObjectiveFn = Callable[[nnx.Module, Mapping[str, nnx.Module], Batch, jax.Array], ObjectiveOutput]


@dataclasses.dataclass(frozen=True)
class Objective:
  """What the step optimises: the function and the flags the step reads about it."""

  fn: ObjectiveFn
  # False: every data-parallel worker gets the step's key unchanged (draws keyed per row).
  rng_per_worker: bool = True
  # (student, extras, whole batch, step key) -> arrays added to the batch, once per step before
  # the micro-batch split, without gradient (see the module doc); None: nothing to prepare.
  prepare: Callable[..., dict[str, jax.Array]] | None = None
  # The tokenizer's ids its token losses take their softmax over (framework/token_rows.py), for
  # evaluation's per-token values to count the same rows; None: every row of the vocabulary.
  token_rows: int | None = None

  def __call__(self, student, extras, batch, rng) -> ObjectiveOutput:
    """The objective on one batch learned whole: its prepare (if any), then its function."""
    return self.fn(student, extras, self.prepared(student, extras, batch, rng), rng)

  def prepared(self, student, extras, batch, rng) -> Batch:
    """`batch` with what `prepare` adds (unchanged without one)."""
    if self.prepare is None:
      return batch
    return {**batch, **self.prepare(student, extras, batch, rng)}

  def wrapped(self, wrap: Callable[[ObjectiveFn], ObjectiveFn]) -> "Objective":
    """The same objective (flags kept) with its function wrapped, e.g. in adapter dropout."""
    return dataclasses.replace(self, fn=wrap(self.fn))


def as_objective(objective: Objective | ObjectiveFn) -> Objective:
  """A bare function is an objective with the default flags."""
  return objective if isinstance(objective, Objective) else Objective(objective)


def split_microbatches(batch: Batch, accum_steps: int) -> Batch:
  """[B, ...] -> [A, B/A, ...], taking every A-th row so each micro-batch draws evenly from every
  device's block of a data-sharded batch (no resharding needed)."""
  def split(x):
    b = x.shape[0]
    return jnp.swapaxes(x.reshape((b // accum_steps, accum_steps) + x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def _ratio(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  denominator = denominator.astype(jnp.float32)
  return jnp.where(denominator > 0, numerator / jnp.maximum(denominator, 1e-30), 0.0)


def _update_norm(new_params32, params32):
  """The update's norm as the change the fp32 master weights took (optax's updates up to one
  rounding of them). The norm of the updates themselves made XLA split every parameter's Adam
  update into two passes over HBM (the moments with that norm, then the parameters): the
  second pass was ~11 ms of the MoE student's step on a v5e (chip call 31's profile), and
  this form took 8.3 ms off the dense student's (call 47). Each update is one fusion now."""
  return optax.tree.norm(jax.tree.map(jnp.subtract, new_params32, params32))


def _storage_cast(p32, like):
  return jax.tree.map(lambda x, ref: x.astype(ref.dtype), p32, like)


def make_train_step(defs: ModelDefs, objective: Objective, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, *, accum_steps: int = 1,
                    axis_name: str | None = None) -> Callable[[TrainState, Batch], Any]:
  """The step body. Wrap it with a backend from `framework.backends` to run it."""
  objective = as_objective(objective)

  def reduce(x):
    return jax.lax.psum(x, axis_name) if axis_name else x

  def step(state: TrainState, batch: Batch):
    step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    if axis_name and objective.rng_per_worker:
      # Each worker draws its own randomness (dropout) for its own rows of the batch.
      step_rng = jax.random.fold_in(step_rng, jax.lax.axis_index(axis_name))
    params32 = master_dtype_params(state.params)
    if objective.prepare is not None:  # the step's weights as stored: what loss_fn's cast gives
      batch = objective.prepared(*defs.merge(state.params, state.frozen), batch, step_rng)

    def loss_fn(p32, micro_batch, rng):
      student, extras = defs.merge(_storage_cast(p32, state.params), state.frozen)
      out = objective.fn(student, extras, micro_batch, rng)
      return out.loss_sum, out

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accum_steps == 1:
      (_, out), grads = grad_fn(params32, batch, step_rng)
    else:
      micro = split_microbatches(batch, accum_steps)
      first = jax.tree.map(lambda x: x[0], micro)
      out_shape = jax.eval_shape(lambda: grad_fn(params32, first, step_rng))
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

      def body(carry, xs):
        i, mb = xs
        mb = jax.tree.map(lambda x: pt.constrain(x, ("batch",) + (None,) * (x.ndim - 1)), mb)
        res = grad_fn(params32, mb, jax.random.fold_in(step_rng, i))
        return jax.tree.map(jnp.add, carry, res), None

      ((_, out), grads), _ = jax.lax.scan(body, zeros, (jnp.arange(accum_steps), micro))

    tokens = reduce(out.tokens.astype(jnp.float32))
    denom = jnp.maximum(tokens, 1.0)
    grads = jax.tree.map(lambda g: reduce(g) / denom, grads)
    loss = reduce(out.loss_sum) / denom
    sums = {k: reduce(v) / denom for k, v in out.sums.items()}
    sums.update({k: _ratio(reduce(n), reduce(d)) for k, (n, d) in out.ratios.items()})

    updates, opt_state = tx.update(grads, state.opt_state, params32)
    new_params32 = optax.apply_updates(params32, updates)
    new_params = _storage_cast(new_params32, state.params)
    metrics = {"loss": loss, "tokens": tokens, "grad_norm": optax.tree.norm(grads),
               "update_norm": _update_norm(new_params32, params32),
               "learning_rate": jnp.asarray(schedule(state.step), jnp.float32), **sums}
    new_state = state.replace(step=state.step + 1, params=new_params, opt_state=opt_state)
    return new_state, metrics

  return step


# The key of an eval step's ratio parts: {name: (numerator sum, denominator sum)}.
EVAL_RATIOS = "ratios"


def make_eval_step(defs: ModelDefs, objective: Objective, *, axis_name: str | None = None):
  """(state, batch) -> sums {"loss_sum", "tokens", **metric sums, EVAL_RATIOS: {name:
  (numerator, denominator)}}, for exact eval means (a ratio's parts add up over batches)."""

  def reduce(x):
    return jax.lax.psum(x, axis_name) if axis_name else x

  def step(state: TrainState, batch: Batch):
    student, extras = defs.merge(state.params, state.frozen)
    out = objective(student, extras, batch, jax.random.wrap_key_data(state.rng))
    return {"loss_sum": reduce(out.loss_sum), "tokens": reduce(out.tokens.astype(jnp.float32)),
            **{k: reduce(v) for k, v in out.sums.items()},
            EVAL_RATIOS: {k: (reduce(n), reduce(d)) for k, (n, d) in out.ratios.items()}}

  return step
