"""Assembles models, optimizer, state layout and a compiled step: what every job needs first.

The trainer, the tests and the benchmarks all go through `build_engine`, so the step they measure
is the step users run; `framework.evaluation.evaluate(engine, state, batches)` evaluates one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from distillax import partitioning as pt
from distillax.data.batch import check_batch_size
from distillax.errors import ConfigError
from distillax.framework import backends, optim
from distillax.framework.state import (Reloaded, StateLayout, TrainState, build_layout,
                                       frozen_tree, init_state)
from distillax.framework.step import Objective, make_train_step


@dataclasses.dataclass
class Engine:
  layout: StateLayout
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  runner: backends.StepRunner
  mesh: Mesh
  rules: pt.RuleSet
  objective: Objective  # the one evaluation runs (training may add dropout on top)
  # Compiled eval functions by what they compute; framework.evaluation.evaluate fills it.
  evals: dict = dataclasses.field(default_factory=dict)
  # (engine, state) -> figures that are not sums over the eval batches' tokens (an on-policy
  # engine samples held-out completions and has the teacher grade them); evaluate adds them.
  extra_eval: Callable[["Engine", Any], dict[str, float]] | None = None

  def init_state(self, student: nnx.Module, extras: Mapping[str, nnx.Module], seed: int):
    """Fresh state placed for this backend."""
    return self.runner.place_state(init_state(student, extras, self.tx, self.layout, seed))

  def restored_state(self, stored: TrainState, student: nnx.Module,
                     extras: Mapping[str, nnx.Module]):
    """A checkpoint's state (`layout.stored_abstract`) made whole with the frozen models
    rebuilt from their sources (`student`, `extras`: real modules), placed for this backend."""
    frozen = frozen_tree(student, extras, self.layout)
    return self.runner.place_state(self.layout.reloaded.joined(stored, frozen))

  def global_state(self, state) -> TrainState:
    """The state as GSPMD arrays on the mesh, whatever the backend (no copy under `jit`)."""
    return jax.device_put(self.runner.fetch_state(state), self.layout.shardings)


def with_extra_eval(engine: Engine, fn: Callable[[Engine, Any], dict[str, float]]) -> Engine:
  """`engine` whose evals also report `fn`'s figures, after those of its own extra_eval (an
  on-policy engine's held-out samples and the generation eval's scores side by side)."""
  before = engine.extra_eval
  if before is None:
    return dataclasses.replace(engine, extra_eval=fn)
  return dataclasses.replace(engine, extra_eval=lambda e, s: {**before(e, s), **fn(e, s)})


GRADIENT_REDUCTIONS = ("auto", "per_step", "per_use")


def reduces_once(mode: str, accum_steps: int, student: nnx.Module, layout: StateLayout,
                 backend: str, platform: str = "cpu") -> bool:
  """Whether the jit step all-reduces gradients once per step (`per_step`) rather than where
  GSPMD produces each contribution (`per_use`).

  `auto` reduces once when that saves traffic: with accumulation (else one reduction per
  micro-batch), tied embeddings (else the table twice on compilers that do not reassociate
  the sum), and whenever the step compiles for XLA:CPU (`platform`), which moves no reduction
  out of a loop: there the token loss's vocabulary-chunk loop all-reduces the whole output
  layer's gradient once per chunk (Llama 3.1 8B under dp: 8 chunks, 1.46x the gradient's bytes
  per step). The TPU and GPU compilers move those reductions out of the loop, so there
  per-use reductions stay, which the compiler can overlap with the rest of the backward pass.
  Only applies when nothing in the state is split over data.
  """
  if mode not in GRADIENT_REDUCTIONS:
    raise ConfigError(f"partitioning.gradient_reduction={mode!r} is unknown; use one of "
                      f"{', '.join(GRADIENT_REDUCTIONS)}")
  if mode == "per_step" and backend == "jit" and layout.shardings is not None:
    if backends.state_split_over_data(layout):
      raise ConfigError(
          "partitioning.gradient_reduction=per_step needs parameters replicated over the data "
          "axis, but partitioning.strategy shards them over it; use strategy dp or tp, or "
          "gradient_reduction=auto")
  if mode != "auto":
    return mode == "per_step"
  tied = bool(getattr(getattr(student, "config", None), "tie_embeddings", False))
  return accum_steps > 1 or tied or platform == "cpu"


def build_engine(student: nnx.Module, extras: Mapping[str, nnx.Module], objective: Objective,
                 optimizer_cfg: Any, total_steps: int, mesh: Mesh, rules: pt.RuleSet,
                 backend: str, batch_shapes: Mapping[str, jax.ShapeDtypeStruct], *,
                 accum_steps: int = 1, trainable: Any = nnx.Param,
                 compile_now: bool | str = "background",
                 eval_objective: Objective | None = None,
                 gradient_reduction: str = "auto", reloaded: Reloaded = Reloaded()) -> Engine:
  """`student`/`extras` may be abstract (nnx.eval_shape) or real modules: only shapes are read.

  `reloaded` names the frozen models that checkpoints leave out (see `state.Reloaded`).
  `compile_now`: 'background' (the step is lowered here and compiles in a worker thread while the
  caller goes on, creating the models say; the runner waits for it where it is first used),
  True (compiled before this returns) or False (compiled on its first call).
  `eval_objective` (default: `objective`) serves evaluation, e.g. without training-only dropout.
  `gradient_reduction` is `partitioning.gradient_reduction`; see `reduces_once`.
  """
  global_batch = next(iter(batch_shapes.values())).shape[0]
  data_parallel = mesh.shape[backends.DATA_AXIS] if backend != "pmap" else jax.device_count()
  check_batch_size(global_batch, data_parallel=data_parallel, accum_steps=accum_steps,
                   process_count=jax.process_count())
  _, trainable_state, _ = nnx.split(student, trainable, ...)
  tx, schedule = optim.make_optimizer(optimizer_cfg, total_steps,
                                      nnx.to_pure_dict(trainable_state))
  layout = build_layout(student, extras, tx, mesh, rules, trainable, reloaded)
  make_step = lambda axis: make_train_step(layout.defs, objective, tx, schedule,
                                           accum_steps=accum_steps, axis_name=axis)
  once = reduces_once(gradient_reduction, accum_steps, student, layout, backend,
                      platform=mesh.devices.flat[0].platform)
  runner = backends.build_runner(backend, make_step, layout, mesh, rules, batch_shapes,
                                 compile_now=compile_now, reduce_once=once)
  return Engine(layout, tx, schedule, runner, mesh, rules, eval_objective or objective)


__all__ = ["Engine", "TrainState", "build_engine"]
