"""The eval's compiled programs, and their compile ahead of the first eval.

`evaluate` (evaluation.py) runs two kinds of programs per engine: the sums of the eval objective
over one batch (a `jit` of step.make_eval_step, kept in `engine.evals`; a distillation job's
teacher metrics are among them) and the eager adds that total those sums over the batches. Each
compiles on its first call, so a run's first eval used to compile them there, after everything
else: on the lent TPU v5e, distill_qwen3.py's eval at step 2 took 21 s, most of it compiling.

`compile_ahead(engine, batches)` starts that work on the step compile's worker threads
(step_program.in_background) when the run starts, beside the train step's compile and the
creation of the models: it reads the first batch of `batches()`, lowers the sums for the
engine's state layout and that batch, compiles them, and (one process) runs the adds once on
zeros of the sums' shapes and shardings, which is what compiles an eager op. The eval then
calls the executable compiled ahead whenever its arguments have the shapes, dtypes and
shardings it was compiled for (the same trace, the same program, the same numbers), and the
`jit` otherwise, which compiles as it always did. A failure ahead of the eval (reading its
data, compiling) is left to the eval: its own call then raises it where it always did.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from distillax import partitioning as pt
from distillax.framework import backends, step_program
from distillax.framework.step import make_eval_step


def signature(args) -> tuple:
  """What decides which executable runs `args` (abstract values or arrays alike): the tree,
  and each leaf's shape, dtype and sharding."""
  leaves, tree = jax.tree.flatten(args)
  return tree, tuple((tuple(x.shape), x.dtype, x.sharding) for x in leaves)


class EvalProgram:
  """`fn` (a jit) and the executables compiled for it ahead of its calls, by signature."""

  def __init__(self, fn):
    self.fn = fn
    self.ahead: dict[tuple, Any] = {}
    self.pending: concurrent.futures.Future | None = None  # compile_ahead's work, not waited

  def __call__(self, *args):
    if self.pending is not None:
      self._wait()
    executable = self.ahead.get(signature(args)) if self.ahead else None
    return (self.fn if executable is None else executable)(*args)

  def _wait(self) -> None:
    pending, self.pending = self.pending, None
    try:
      pending.result()
    except Exception as e:  # noqa: BLE001 - the jit's own call raises it again, here
      logging.info("the eval's programs did not compile ahead of it (%s: %s); compiling them "
                   "now", type(e).__name__, e)


def program(engine, name: str, body: Callable) -> EvalProgram:
  """jit(body) under the engine's mesh and rules, made once per engine (`engine.evals`)."""
  if name not in engine.evals:
    mesh, rules = engine.mesh, engine.rules

    def traced(state, batch):
      with pt.use_rules(mesh, rules):
        return body(state, batch)
    engine.evals[name] = EvalProgram(jax.jit(traced))
  return engine.evals[name]


def sums_program(engine) -> EvalProgram:
  """(state, placed batch) -> the eval objective's sums over the batch (step.make_eval_step)."""
  return program(engine, "sums", make_eval_step(engine.layout.defs, engine.objective))


def compile_ahead(engine, batches: Callable[[], Iterable[Mapping[str, np.ndarray]]]) -> None:
  """Compiles `engine`'s eval programs in the background for the first batch of `batches()`
  (host numpy batches, as `evaluate` takes them): see the module's doc. Returns at once."""
  sums = sums_program(engine)
  if sums.pending is None and not sums.ahead:
    sums.pending = step_program.in_background(lambda: _compile(engine, sums, batches))


def _compile(engine, sums: EvalProgram, batches) -> None:
  start = time.perf_counter()
  first = next(iter(batches()), None)
  if first is None:  # no eval batches: the eval says so itself
    return
  placed = backends.global_batch_placer(engine.mesh, engine.rules)(first)
  args = (backends.sharded_abstract_state(engine.layout),
          {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
           for k, x in placed.items()})
  compiled = sums.fn.lower(*args).compile()
  if jax.process_count() == 1:  # several processes: no program runs out of the main thread's order
    _run_adds(compiled)
  sums.ahead[signature(args)] = compiled
  logging.info("compiled the eval's programs ahead of it in %.1f s",
               time.perf_counter() - start)


def _run_adds(compiled) -> None:
  """evaluate's adds of two batches' sums (eager jnp.add, a program per signature, compiled on
  its first call), run once on zeros of each signature the sums come out with."""
  seen = set()
  for out, sharding in zip(jax.tree.leaves(compiled.out_info),
                           jax.tree.leaves(compiled.output_shardings)):
    if (out.shape, out.dtype, sharding) in seen:
      continue
    seen.add((out.shape, out.dtype, sharding))
    zero = jax.device_put(np.zeros(out.shape, out.dtype), sharding)
    jax.block_until_ready(jnp.add(jnp.add(zero, zero), zero))
