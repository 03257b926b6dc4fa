"""Per-step training metrics: accumulated on device, fetched one step late, written on process 0.

The train step returns a flat `{name: scalar jax.Array}` dict. Reading it on the host right away
would block until that step finishes and leave the device idle while Python prepares the next
one. So `MetricLogger.record(step, metrics)`:

  1. folds the step's metrics into a `clu.metrics` collection on device (one tiny jitted merge;
     the mean over the `log_every` window for most names, the last value for learning rates),
  2. at a log step, starts the copy of the window's result to the host and keeps it pending,
  3. converts the *previous* pending result to floats and writes it (step N-1 is done or nearly
     so by the time step N has been dispatched), measuring throughput between those fetches.

`flush()` fetches what is pending (before eval, checkpoints, exit) and `close()` also logs a
partial last window. Host-side values (eval results) go through `write()` as rows of their own.

Windows end at multiples of `log_every`. A run stopped or killed between two of them resumes
from a checkpoint that carries the open window (`window_state()`, `restore_window()`), so the
resumed run's rows equal an uninterrupted run's, row for row (the timing keys aside).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

import jax
import numpy as np
from clu import metrics as clu_metrics

from distillax.framework.throughput import Throughput
from distillax.framework.run.writers import MetricWriter

# Names whose window value is the last step's, not the mean (schedules, counters).
DEFAULT_LAST_VALUE_NAMES = ("learning_rate", "lr", "step", "tokens_seen")


def to_host_scalar(x) -> float:
  """A float from a scalar jax.Array, also when it spans other processes' devices (multi-host).

  A 0-d array is replicated by construction, so every process reads it from a local device
  (jax.device_get would refuse a not fully addressable array).
  """
  return float(np.asarray(x))


def collection_class(names, last_value_names=DEFAULT_LAST_VALUE_NAMES):
  """A clu Collection type with one field per metric name: Average, or LastValue for schedules."""
  fields = {name: (clu_metrics.LastValue if name in last_value_names else clu_metrics.Average)
                  .from_output(name)
            for name in names}
  return clu_metrics.Collection.create(**fields)


class StepAccumulator:
  """Running clu collection over a window of steps, merged on device by one jitted call per step."""

  def __init__(self, last_value_names=DEFAULT_LAST_VALUE_NAMES):
    self._last_value_names = tuple(last_value_names)
    self._names: tuple[str, ...] | None = None
    self._order: tuple[str, ...] = ()
    self._start_fn = self._merge_fn = self._compute_fn = None
    self.collection = None
    self.num_steps = 0
    self._restored = False  # the collection holds a restored window's host arrays

  def _build(self, names: tuple[str, ...]):
    cls = collection_class(names, self._last_value_names)
    self._names = names
    self._start_fn = jax.jit(lambda m: cls.single_from_model_output(**m))
    self._merge_fn = jax.jit(lambda acc, m: acc.merge(cls.single_from_model_output(**m)))
    self._compute_fn = jax.jit(lambda acc: acc.compute())

  def add(self, metrics: Mapping[str, jax.Array]):
    names = tuple(sorted(metrics))
    self._order = tuple(metrics)
    for name in names:
      if np.ndim(metrics[name]) != 0:
        raise ValueError(f"metric '{name}' has shape {np.shape(metrics[name])}: per-step metrics "
                         "must be scalars (reduce them inside the step)")
    if names != self._names:
      if self.collection is not None:
        raise ValueError(f"metric names changed within a logging window: {self._names} -> {names}")
      self._build(names)
    metrics = dict(metrics)
    if self.collection is None:
      self.collection = self._start_fn(metrics)
    else:
      if self._restored:  # host leaves onto the metrics' devices: the merge a fresh window runs
        sharding = getattr(metrics[names[0]], "sharding", None)
        if sharding is not None:
          self.collection = jax.device_put(self.collection, sharding)
        self._restored = False
      self.collection = self._merge_fn(self.collection, metrics)
    self.num_steps += 1

  def state(self) -> dict | None:
    """The open window as exact JSON (None when empty): names, key order, step count, and each
    collection leaf as (dtype, value), floats as hex strings so nothing is rounded or non-JSON."""
    if self.collection is None:
      return None
    leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(self.collection)]
    return {"names": list(self._names), "order": list(self._order), "num_steps": self.num_steps,
            "leaves": [[str(a.dtype), float(a).hex() if a.dtype.kind == "f" else int(a)]
                       for a in leaves]}

  def restore(self, state: dict | None) -> None:
    """Reopens a window saved by `state()` (None: an empty window); the next `add` merges into
    it exactly as it would have into the original."""
    self.collection, self.num_steps = None, 0
    if not state:
      return
    names = tuple(state["names"])
    if names != self._names:
      self._build(names)
    self._order = tuple(state["order"])
    template = jax.eval_shape(self._start_fn, {n: jax.ShapeDtypeStruct((), np.float32)
                                               for n in names})
    leaves = [np.asarray(float.fromhex(v) if isinstance(v, str) else v, dtype=np.dtype(dtype))
              for dtype, v in state["leaves"]]
    self.collection = jax.tree.unflatten(jax.tree.structure(template), leaves)
    self.num_steps = int(state["num_steps"])
    self._restored = True

  def take(self) -> dict[str, jax.Array]:
    """The window's values as device arrays (copy to host started), and reset the window."""
    computed = self._compute_fn(self.collection)
    values = {name: computed[name] for name in self._order}  # the step's own key order
    for value in values.values():
      value.copy_to_host_async()
    self.collection, self.num_steps = None, 0
    return values


class MetricLogger:
  """Logs device metrics every `log_every` steps through `writer`, one step late (see module doc).

  throughput: if given, every row after the first also gets step_time_s, tokens_per_s,
  tflops_per_device and mfu, timed between consecutive fetches (the first window includes
  compilation, so it gets none).
  """

  def __init__(self, writer: MetricWriter, *, log_every: int = 1,
               throughput: Throughput | None = None,
               last_value_names=DEFAULT_LAST_VALUE_NAMES,
               clock: Callable[[], float] = time.perf_counter):
    if log_every < 1:
      raise ValueError(f"log_every must be >= 1, got {log_every}")
    self.writer = writer
    self.log_every = log_every
    self.throughput = throughput
    self._clock = clock
    self._window = StepAccumulator(last_value_names)
    self._pending: tuple[int, dict[str, jax.Array]] | None = None
    self._last_step: int | None = None
    self._last_fetch: tuple[int, float] | None = None  # (step, time) of the previous fetch
    self._paused_at: float | None = None  # when the current pause() began
    self._untimed_s = 0.0  # paused time since the previous fetch: not step time
    self.latest: dict[str, float] | None = None        # the last row written (host floats)

  def record(self, step: int, metrics: Mapping[str, jax.Array]) -> dict[str, float] | None:
    """Take step `step`'s device metrics; returns the row written now (an earlier step's) or None."""
    self._window.add(metrics)
    self._last_step = step
    written = self._fetch_pending()
    if step % self.log_every == 0:
      self._pending = (step, self._window.take())
    return written

  def write(self, step: int, scalars: Mapping[str, float]) -> dict[str, float]:
    """Write host-side values (eval results, ...) as their own row at `step`.

    Pending train rows are written first, so the file stays in step order. Wrap the work that
    made them in pause()/resume() so that it is not counted as step time.
    """
    self._fetch_pending()
    row = {name: float(value) for name, value in scalars.items()}
    self.writer.write_scalars(step, row)
    return row

  def pause(self, block_on=None) -> None:
    """Starts a stretch of work that is not a train step (eval, checkpoint save, rollback):
    blocks until `block_on` (the train state) is computed, so every step dispatched so far is
    inside the timed interval, then stops the step clock until resume(). Throughput is thus
    measured over train steps only, also when the pause falls inside a logging window (the
    window's row would otherwise count the eval as step time)."""
    if block_on is not None:
      jax.block_until_ready(block_on)
    self._paused_at = self._clock()

  def resume(self) -> None:
    """Ends the stretch begun by pause(): its time is left out of the next row's step time."""
    if self._paused_at is not None:
      self._untimed_s += self._clock() - self._paused_at
      self._paused_at = None

  def rolled_back(self, from_step: int, to_step: int, fields: Mapping[str, float]) -> None:
    """Marks the rows of the abandoned trajectory (steps after `to_step`, see
    writers.JsonlWriter.mark_rolled_back) and writes the rollback's own row at `from_step`:
    {"rolled_back_to": to_step, **fields}. The steps after `to_step` are counted again from
    there."""
    self._fetch_pending()
    mark = getattr(self.writer, "mark_rolled_back", None)
    if mark is not None:
      mark(to_step)
    self.writer.write_scalars(from_step, {"rolled_back_to": float(to_step), **fields})
    self.writer.flush()
    # The interval since the last fetch holds steps of the abandoned trajectory: the next row
    # is not timed (as the first, which holds compilation), the ones after it are.
    self._last_step, self._last_fetch, self._untimed_s = to_step, None, 0.0

  def flush(self) -> dict[str, float] | None:
    """Fetch and write what is pending, and flush the writers."""
    written = self._fetch_pending()
    self.writer.flush()
    return written

  def window_state(self) -> dict | None:
    """The window still open after the last log step (exact JSON, for a checkpoint; None when
    empty). Call flush() first so that every finished window is written."""
    state = self._window.state()
    if state is None:
      return None
    return {"log_every": self.log_every, "last_step": self._last_step, **state}

  def restore_window(self, state: dict | None) -> None:
    """Continues the window a checkpoint carried (after resume or rollback); an empty window
    when there is none or it was cut for another `log_every`."""
    if state is not None and int(state.get("log_every", 0)) != self.log_every:
      state = None
    self._window.restore(state)
    if state is not None:
      self._last_step = int(state["last_step"])

  def close(self, *, log_partial: bool = True) -> dict[str, float] | None:
    """Log a partial last window too (unless `log_partial` is False: a stopped run's checkpoint
    carries it instead), then flush and close the writers."""
    written = self._fetch_pending()
    if log_partial and self._window.num_steps:
      self._pending = (self._last_step, self._window.take())
      written = self._fetch_pending()
    self.writer.flush()
    self.writer.close()
    return written

  def _fetch_pending(self) -> dict[str, float] | None:
    if self._pending is None:
      return None
    step, device_values = self._pending
    self._pending = None
    row = {name: to_host_scalar(value) for name, value in device_values.items()}
    now = self._clock()  # the fetch blocked until `step` finished: a completion timestamp
    untimed = self._untimed_s
    if self._paused_at is not None:  # a fetch inside a pause: its start belongs to this row
      untimed, self._paused_at = untimed + now - self._paused_at, now
    if self.throughput is not None and self._last_fetch is not None:
      previous_step, previous_time = self._last_fetch
      row.update(self.throughput.rates(step - previous_step, now - previous_time - untimed))
    self._last_fetch, self._untimed_s = (step, now), 0.0
    self.writer.write_scalars(step, row)
    self.latest = row
    return row
