"""Run the one step body under `jit` (GSPMD), `shard_map`, `pmap` or `vmap(axis_name=...)`.

Each backend owns three things only: where the state lives (`place_state` / `fetch_state`), how
a process-local numpy batch becomes device input (`place_batch`), and the compiled call. The
step body is the same function everywhere; `shard_map`, `pmap` and `vmap` pass it the data axis
name so it reduces explicitly, and they are data parallel (parameters replicated).

`jit`, `shard_map` and `vmap` lower the step where `build_runner` is called and compile it in a
background thread (framework/step_program.py): the runner's call, `compiled` and `stats` wait
for that compile, the one compile of the program that runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distillax import partitioning as pt
from distillax.errors import ConfigError
from distillax.framework.state import StateLayout, TrainState
from distillax.framework.step_program import AotStep, compiled_stats

BACKENDS = ("jit", "shard_map", "pmap", "vmap")
DATA_AXIS = "data"
BATCH_LOGICAL = ("batch", "length")


def flops_words(stats: Mapping[str, float]) -> str:
  """XLA's FLOPs figure of a compiled step as a log says it; the GPU compiler reports none
  (deviceless or not), which is said in words, not as `nan FLOPs`."""
  flops = stats.get("flops")
  if flops is None or not math.isfinite(flops) or flops < 0:
    return "no FLOPs figure from this compiler"
  return f"{flops:.3g} FLOPs"


def log_compiled_stats(backend: str, stats: Mapping[str, float]) -> None:
  if not stats:
    return
  fmt = pt.shard.format_bytes
  logging.info(
      "compiled %s step, per device: arguments %s, temporaries %s, outputs %s (aliased %s); "
      "%s", backend, fmt(stats.get("argument_size_in_bytes", 0)),
      fmt(stats.get("temp_size_in_bytes", 0)), fmt(stats.get("output_size_in_bytes", 0)),
      fmt(stats.get("alias_size_in_bytes", 0)), flops_words(stats))


@dataclasses.dataclass
class StepRunner:
  """A compiled step for one backend, with the placement rules of that backend."""

  backend: str
  call: Callable[[Any, Any], tuple[Any, dict]]
  place_state: Callable[[TrainState], Any]
  fetch_state: Callable[[Any], TrainState]
  place_batch: Callable[[Mapping[str, np.ndarray]], Any]
  data_parallel: int
  # "per_step": one explicit psum of the summed gradient (shard_map, pmap, vmap, jit per worker);
  # "per_use": GSPMD reduces each contribution where it is produced.
  gradient_reduction: str = "per_step"
  # The step compiled ahead of time (maybe still compiling), or None where the step compiles on
  # its first call (pmap; compile_now=False). Kept apart from `call` so a wrapper that replaces
  # `call` (a timing clock, say) never hides the program that runs.
  program: AotStep | None = None

  def __call__(self, state, batch):
    return self.call(state, batch)

  @property
  def compiled(self):
    """The compiled executable behind `call` (None when nothing was compiled ahead of time);
    waits for a compile still running."""
    return None if self.program is None else self.program.executable

  @property
  def stats(self) -> dict[str, float]:
    """Per-device memory and FLOPs of the compiled step (waits for its compile)."""
    return {} if self.program is None else self.program.stats

  @property
  def compile_seconds(self) -> float:
    """Lowering plus XLA's compile (waits for it); 0 where nothing was compiled ahead of time."""
    program = self.program
    return 0.0 if program is None else program.lower_seconds + program.compile_seconds

  def wait(self) -> "StepRunner":
    """Returns once the step is compiled (raising its compile error, if any)."""
    if self.program is not None:
      self.program.executable  # noqa: B018 - reading it waits
    return self

  def compiled_text(self) -> str:
    """The optimised, partitioned HLO of the step that runs (what plan and the collective
    counts read); an error rather than an empty text when nothing was compiled."""
    if self.program is None:
      raise ValueError(f"the {self.backend} step was built with compile_now=False: nothing "
                       f"compiled to read")
    return self.compiled.as_text()


def _require_data_parallel(backend: str, mesh: Mesh, layout: StateLayout) -> None:
  if mesh.shape.get("model", 1) != 1:
    raise ConfigError(
        f"backend={backend} is data parallel only, but mesh.model={mesh.shape['model']}; set "
        f"--config.mesh.model=1, or use backend=jit for tensor parallelism")
  specs = jax.tree.leaves(layout.shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  if any(any(a is not None for a in s.spec) for s in specs):
    raise ConfigError(
        f"backend={backend} keeps parameters replicated, but partitioning.strategy shards them; "
        f"use --config.partitioning.strategy=dp, or backend=jit for fsdp/tp/fsdp_tp")


def batch_sharding(mesh: Mesh, rules: pt.RuleSet, ndim: int, shape) -> NamedSharding:
  """How a global batch array of `shape` is laid out: ('batch', 'length') by the rules."""
  logical = BATCH_LOGICAL[:ndim] + (None,) * max(0, ndim - len(BATCH_LOGICAL))
  return NamedSharding(mesh, rules.resolve(logical, shape, mesh, "batch"))


def global_batch_placer(mesh: Mesh, rules: pt.RuleSet):
  """Process-local numpy batches -> global arrays sharded like ('batch', 'length')."""
  def place(batch):
    def one(x):
      x = np.asarray(x)
      global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
      sh = batch_sharding(mesh, rules, x.ndim, global_shape)
      return jax.make_array_from_process_local_data(sh, x, global_shape)
    return {k: one(v) for k, v in batch.items()}
  return place


def state_split_over_data(layout: StateLayout) -> bool:
  """Whether any array of the train state is sharded over the data axis (fsdp, fsdp_tp)."""
  specs = jax.tree.leaves(layout.shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  return any(DATA_AXIS in pt.axes_tuple(a) for s in specs for a in s.spec)


def _runs_per_data_worker(mesh: Mesh, layout: StateLayout,
                          batch_sh: Mapping[str, NamedSharding]) -> bool:
  """Whether the jit step can run as one body per data-parallel worker: nothing in the state is
  split over the data axis (dp, tp), and every batch input is split over it on dim 0 only."""
  if mesh.shape[DATA_AXIS] == 1 or state_split_over_data(layout):
    return False
  for sh in batch_sh.values():
    spec = tuple(sh.spec)
    if not spec or pt.axes_tuple(spec[0]) != (DATA_AXIS,):
      return False
    if any(DATA_AXIS in pt.axes_tuple(a) for a in spec[1:]):
      return False
  return True


def _per_data_worker(body: Callable, mesh: Mesh, rules: pt.RuleSet,
                     batch_sh: Mapping[str, NamedSharding]) -> Callable:
  """`body` (built with the data axis name) under `shard_map` over the data axis alone.

  Why: with replicated parameters GSPMD all-reduces every gradient contribution where it is
  produced, so a scanned accumulation of A micro-batches moves A gradients per step, and a tied
  embedding (lookup + output projection) moves its table twice unless the compiler reassociates
  the sum (XLA:CPU does not). Per worker, the body sums all of that locally and `psum`s once.
  The price: that one reduction waits for the whole backward pass, where GSPMD's per-layer
  reductions can overlap it. The model axis stays automatic, so tensor parallelism still follows
  the logical rules.
  """
  inner_rules = rules.without_mesh_axes([DATA_AXIS])

  def local(state, batch):
    with pt.use_rules(jax.sharding.get_abstract_mesh(), inner_rules):
      return body(state, batch)

  return jax.shard_map(local, mesh=mesh, in_specs=(P(), {k: P(DATA_AXIS) for k in batch_sh}),
                       out_specs=(P(), P()), axis_names={DATA_AXIS}, check_vma=False)


STEP_NAME = "train_step"  # what compile logs, profiles and the persistent cache call the step


def _named(fn: Callable) -> Callable:
  """`fn` under STEP_NAME (jit names its program after the function it traces)."""
  fn.__name__ = fn.__qualname__ = STEP_NAME
  return fn


def _donated(donate: bool) -> tuple[int, ...]:
  """The state (argument 0) is donated so the update reuses its buffers, unless told not to."""
  return (0,) if donate else ()


def _compiled(fn, abstract_state, abstract_batch, compile_now: bool | str, backend: str):
  """`fn` lowered here and compiled ahead of time (an AotStep: in the background when
  `compile_now` is 'background'), or `fn` itself (compiled on first call) if not `compile_now`."""
  if not compile_now:
    return fn
  start = time.perf_counter()
  lowered = fn.lower(abstract_state, abstract_batch)
  return AotStep(lowered, lower_seconds=time.perf_counter() - start,
                 background=compile_now == "background",
                 on_ready=lambda stats: log_compiled_stats(backend, stats))


def sharded_abstract_state(layout: StateLayout):
  """The state's shapes and dtypes with their shardings, for lowering before any array exists."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      layout.abstract, layout.shardings)


def _jit_body(make_step: Callable[[str | None], Callable], mesh: Mesh, rules: pt.RuleSet,
              batch_sh: Mapping[str, NamedSharding], per_worker: bool) -> Callable:
  """The step body jit traces: per data-parallel worker (explicit psum), or one GSPMD program
  under the logical rules (GSPMD inserts the reductions)."""
  if per_worker:
    traced = _per_data_worker(make_step(DATA_AXIS), mesh, rules, batch_sh)
    logging.info("jit step runs per data-parallel worker (parameters are replicated over "
                 "'%s'): gradients are all-reduced once per step", DATA_AXIS)
    return traced
  body = make_step(None)

  def traced(state, batch):
    with pt.use_rules(mesh, rules):
      return body(state, batch)
  return traced


def _jit_runner(make_step, layout: StateLayout, mesh: Mesh, rules: pt.RuleSet, batch_shapes,
                *, donate: bool, compile_now: bool | str, reduce_once: bool) -> StepRunner:
  """GSPMD: the state keeps the layout's shardings, the batch is split by the logical rules."""
  batch_sh = {k: batch_sharding(mesh, rules, len(v.shape), v.shape)
              for k, v in batch_shapes.items()}
  per_worker = reduce_once and _runs_per_data_worker(mesh, layout, batch_sh)
  traced = _jit_body(make_step, mesh, rules, batch_sh, per_worker)
  fn = jax.jit(_named(traced), in_shardings=(layout.shardings, batch_sh),
               out_shardings=(layout.shardings, NamedSharding(mesh, P())),
               donate_argnums=_donated(donate))
  abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sh[k])
                    for k, v in batch_shapes.items()}
  call = _compiled(fn, sharded_abstract_state(layout), abstract_batch, compile_now, "jit")
  return StepRunner("jit", call, lambda s: jax.device_put(s, layout.shardings), lambda s: s,
                    global_batch_placer(mesh, rules), mesh.shape[DATA_AXIS],
                    gradient_reduction="per_step" if per_worker else "per_use")


def _shard_map_runner(make_step, layout: StateLayout, mesh: Mesh, rules: pt.RuleSet,
                      batch_shapes, *, donate: bool, compile_now: bool | str,
                      reduce_once: bool) -> StepRunner:
  """Data parallel under `shard_map`: replicated state, batch split over 'data' on dim 0."""
  del reduce_once  # the body always reduces explicitly, once per step
  _require_data_parallel("shard_map", mesh, layout)
  body = make_step(DATA_AXIS)
  rep = NamedSharding(mesh, P())
  batch_spec = {k: P(DATA_AXIS) for k in batch_shapes}
  mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), batch_spec), out_specs=(P(), P()),
                         check_vma=False)
  fn = jax.jit(_named(mapped), donate_argnums=_donated(donate))
  abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                            sharding=NamedSharding(mesh, P(DATA_AXIS)))
                    for k, v in batch_shapes.items()}
  call = _compiled(fn, sharded_abstract_state(layout), abstract_batch, compile_now, "shard_map")
  return StepRunner("shard_map", call, lambda s: jax.device_put(s, rep), lambda s: s,
                    global_batch_placer(mesh, rules), mesh.shape[DATA_AXIS])


def _pmap_runner(make_step, layout: StateLayout, mesh: Mesh, rules: pt.RuleSet, batch_shapes,
                 *, donate: bool, compile_now: bool | str, reduce_once: bool) -> StepRunner:
  """Data parallel under `pmap` over this process's devices: the state is stacked per device
  and the batch reshaped to (devices, per-device batch). pmap compiles on first call."""
  del rules, batch_shapes, compile_now, reduce_once
  _require_data_parallel("pmap", mesh, layout)
  body = make_step(DATA_AXIS)
  n_local = jax.local_device_count()
  fn = jax.pmap(body, axis_name=DATA_AXIS, donate_argnums=_donated(donate))

  # Placed the way pmap lays out its own outputs, so the step compiles once, not again on its
  # second call (numpy in, device arrays out). With several processes pmap's layout spans them
  # all; there the state goes in as numpy and the second call compiles once more.
  local_mesh = Mesh(np.array(jax.local_devices()), (DATA_AXIS,))
  stacked = NamedSharding(local_mesh, P(DATA_AXIS)) if jax.process_count() == 1 else None

  def place_state(s):
    s = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n_local,) + np.shape(x)), s)
    return jax.device_put(s, stacked) if stacked is not None else s

  def fetch_state(s):
    return jax.tree.map(lambda x: x[0], s)

  def place_batch(batch):
    return {k: np.asarray(v).reshape((n_local, -1) + np.shape(v)[1:]) for k, v in batch.items()}

  def call(state, batch):
    new_state, metrics = fn(state, batch)
    return new_state, jax.tree.map(lambda x: x[0], metrics)
  return StepRunner("pmap", call, place_state, fetch_state, place_batch,
                    n_local * jax.process_count())


def _vmap_runner(make_step, layout: StateLayout, mesh: Mesh, rules: pt.RuleSet, batch_shapes,
                 *, donate: bool, compile_now: bool | str, reduce_once: bool) -> StepRunner:
  """N data-parallel workers emulated on one device with `vmap(axis_name='data')`, N the
  mesh's data axis: tests the explicit-reduction body without N devices."""
  del rules, reduce_once
  body = make_step(DATA_AXIS)
  workers = mesh.shape[DATA_AXIS]
  fn = jax.jit(_named(jax.vmap(body, in_axes=(None, 0), out_axes=(None, None),
                               axis_name=DATA_AXIS)),
               donate_argnums=_donated(donate))
  device = jax.local_devices()[0]

  def place_batch(batch):
    return {k: jax.device_put(np.asarray(v).reshape((workers, -1) + np.shape(v)[1:]), device)
            for k, v in batch.items()}
  abstract_batch = {k: jax.ShapeDtypeStruct((workers, v.shape[0] // workers) + v.shape[1:],
                                            v.dtype) for k, v in batch_shapes.items()}
  abstract_single = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                 layout.abstract)
  call = _compiled(fn, abstract_single, abstract_batch, compile_now, "vmap")
  return StepRunner("vmap", call, lambda s: jax.device_put(s, device), lambda s: s,
                    place_batch, workers)


_RUNNER_BUILDERS = {"jit": _jit_runner, "shard_map": _shard_map_runner, "pmap": _pmap_runner,
                    "vmap": _vmap_runner}


def build_runner(backend: str, make_step: Callable[[str | None], Callable], layout: StateLayout,
                 mesh: Mesh, rules: pt.RuleSet, batch_shapes: Mapping[str, jax.ShapeDtypeStruct],
                 *, donate: bool = True, compile_now: bool | str = "background",
                 reduce_once: bool = False) -> StepRunner:
  """Compiles `make_step(axis_name)` for `backend`. `batch_shapes` are the global batch shapes.

  `compile_now`: 'background' (lowered here, compiled in a worker thread; the runner waits for it
  where it is first used), True (compiled here), False (compiled on the first call).
  `reduce_once` (jit only): run the body per data-parallel worker and all-reduce gradients once
  per step, where nothing in the state is split over the data axis; see `_per_data_worker`.
  """
  if backend not in BACKENDS:
    raise ConfigError(f"backend={backend!r} is unknown; use one of {', '.join(BACKENDS)}")
  if layout.shardings is None:
    raise ValueError("build_runner needs a layout built for a mesh")
  runner = _RUNNER_BUILDERS[backend](make_step, layout, mesh, rules, batch_shapes, donate=donate,
                                     compile_now=compile_now, reduce_once=reduce_once)
  if isinstance(runner.call, AotStep):
    runner.program = runner.call
  return runner
