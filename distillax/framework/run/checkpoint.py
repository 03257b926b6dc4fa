"""Checkpoints: train state, data position and metadata in one atomic orbax step; exact resume.

`Checkpointer` wraps one orbax `CheckpointManager` over `<workdir>/checkpoints`. A step holds the
TrainState (params, frozen models, optimizer state, RNG, step), the data iterator's state (one
JSON per process) and a small metadata JSON; orbax writes it under a temporary name and renames
it when every process has finished, so a kill mid-save leaves the previous steps untouched.

Restores read each shard directly onto the *target* shardings, so a checkpoint written under one
mesh and preset (4x2 `fsdp_tp`) restores under another (8x1 `fsdp`, 1x8 `tp`, one device).

Faults: `restore_latest_valid` walks back from the newest step past any that is incomplete or
corrupt, warning with the step and the problem. Nothing is ever deleted except by the retention
policy (keep the last K, plus the best K by a metric), and a step found corrupt is never deleted:
if training later reaches that step number again, the corrupt directory is renamed aside to
`<step>.corrupt-<time>` (still on disk) so the new save can take its place. A save killed
half-way leaves only an orbax temporary directory (`<step>.orbax-checkpoint-tmp-*`), which is
never listed as a step and is left alone.

How the loop uses it (every process makes the same calls):

  ckpt = Checkpointer(workdir / "checkpoints", every_steps=cfg.every_steps, keep_last=3)
  restored = ckpt.restore_latest_valid(abstract_state=layout.abstract, shardings=layout.shardings)
  if restored is not None:
    state, data_state, meta = restored  # data_state: what was passed to save (or None)
  with PreemptionGuard() as guard:
    for step in range(start + 1, total + 1):  # python ints: reading state.step would sync
      state, metrics = train_step(state, batch)
      if guard.should_stop(step):
        ckpt.save(step, state, data_state=it.get_state(), force=True)
        break
      if ckpt.should_save(step):
        ckpt.save(step, state, data_state=it.get_state(), metrics=eval_metrics)
  ckpt.close()  # waits for the last async save
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from distillax.errors import ConfigError, UserError
from distillax.framework.run import checkpoint_items as items
from distillax.framework.run.checkpoint_items import CorruptCheckpointError
from distillax.framework.state import TrainState

log = logging.getLogger(__name__)


def _info_once(message: str, *args) -> None:
  """An INFO line from process 0 only: every process joins each save and restore, and one line
  per checkpoint says it (warnings about a process's own view stay on every process)."""
  if jax.process_index() == 0:
    log.info(message, *args, stacklevel=2)

__all__ = ["Checkpointer", "CorruptCheckpointError"]


@dataclasses.dataclass
class _Retention:
  """orbax PreservationPolicy: the last `keep_last` valid steps, the `keep_best` valid steps with
  the lowest (sign-adjusted) metric, and every step known to be corrupt (evidence is never deleted)."""

  keep_last: int | None
  keep_best: int
  metric_of: Callable[[int], float | None]
  is_invalid: Callable[[int], bool]

  def should_preserve(self, checkpoints: Sequence[Any], *, context: Any = None) -> list[bool]:
    steps = [int(c.step) for c in checkpoints]
    valid = sorted(s for s in steps if not self.is_invalid(s))
    keep = {s for s in steps if self.is_invalid(s)}
    keep |= set(valid if self.keep_last is None else valid[-self.keep_last:])
    if self.keep_best:
      scored = sorted((m, s) for s in valid if (m := self.metric_of(s)) is not None)
      keep |= {s for _, s in scored[:self.keep_best]}
    return [s in keep for s in steps]


def _mesh_of(tree) -> dict[str, int] | None:
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return {str(k): int(v) for k, v in sharding.mesh.shape.items()}
  return None


def _plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
  return {str(k): float(np.asarray(v)) for k, v in (metrics or {}).items()}


class Checkpointer:
  """Periodic async checkpoints with retention, cross-topology restore and corrupt-step fallback.

  Every JAX process must make the same calls in the same order (save, restore, wait, close):
  orbax writes each process's shards and synchronises the processes; the metadata JSON is written
  by `primary_host` only, the data state by every process (its own file).
  """

  def __init__(self, directory: str | epath.PathLike, *, every_steps: int,
               keep_last: int | None = 3, keep_best: int = 0, best_metric: str = "eval_loss",
               async_save: bool = True, primary_host: int = 0, higher_is_better: bool = False):
    if int(every_steps) < 0:
      raise ConfigError(f"checkpoint.every_steps={every_steps} must be >= 0 (0: only forced saves, "
                        f"e.g. at preemption and at the end)")
    if keep_last is not None and int(keep_last) < 1:
      raise ConfigError(f"checkpoint.keep_last={keep_last} must be >= 1 (the newest step is what "
                        f"a resume needs) or None to keep every step")
    if int(keep_best) < 0:
      raise ConfigError(f"checkpoint.keep_best={keep_best} must be >= 0")
    self.directory = epath.Path(directory)
    self.every_steps = int(every_steps)
    self.keep_last = None if keep_last is None else int(keep_last)
    self.keep_best = int(keep_best)
    self.best_metric = best_metric
    # Steps are ranked by the metric times this sign, lowest first (a BLEU ranks by -BLEU).
    self._sign = -1.0 if higher_is_better else 1.0
    self.primary_host = primary_host
    self._metric_by_step: dict[int, float] = {}
    self._invalid_steps: set[int] = set()
    retention = _Retention(self.keep_last, self.keep_best, self._metric_by_step.get,
                           self._invalid_steps.__contains__)
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=async_save,
        preservation_policy=retention,
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=primary_host),
        cleanup_tmp_directories=False,  # a killed save's temp dir is left for the user to inspect
        create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          handler_registry=items.handler_registry(primary_host))
    if self.keep_best:
      for step in self.all_steps():
        self._load_metric(step)
    self._closed = False
    self._writing: tuple[int, float] | None = None  # (step, when its save started)

  # ---- queries ------------------------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Every finalized step on disk (a corrupt one too, until a restore finds it out)."""
    return sorted(int(s) for s in self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """The step with the best `best_metric` (lowest, or highest when higher_is_better; not known
    to be corrupt); the latest if none has the metric; None when there are no steps."""
    steps = [s for s in self.all_steps() if s not in self._invalid_steps]
    scored = sorted((self._metric_by_step[s], s) for s in steps if s in self._metric_by_step)
    return scored[0][1] if scored else (steps[-1] if steps else None)

  def should_save(self, step: int) -> bool:
    """Due by `every_steps` and not yet saved (a step found corrupt counts as not saved)."""
    step = int(step)
    return (self.every_steps > 0 and step > 0 and step % self.every_steps == 0
            and (step not in self.all_steps() or step in self._invalid_steps))

  def step_dir(self, step: int) -> epath.Path:
    return self.directory / str(int(step))

  # ---- save ---------------------------------------------------------------------------------

  def save(self, step: int, state: TrainState, *, data_state: Any = None,
           metrics: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
           force: bool = False) -> bool:
    """Starts saving `state` as `step`; returns whether a save was started.

    Without `force`, saves only when `should_save(step)`. With async saving this returns once the
    arrays are copied off the devices (the state may then be donated or updated); the write
    finishes in the background; `wait()` blocks until it is committed. `metrics` (JSON numbers)
    rank steps for `keep_best` by `best_metric` (lower is better unless higher_is_better);
    `extra` is any small JSON the caller wants back at restore.
    """
    step = int(step)
    if not force and not self.should_save(step):
      return False
    if step in self.all_steps():
      if step not in self._invalid_steps:
        _info_once("checkpoint step %d already exists in %s; not saving it again", step,
                   self.directory)
        return False
      self._move_aside(step, "corrupt")
    data_json = items.to_json(data_state, "data_state")
    plain_metrics = _plain_metrics(metrics)
    meta = {"step": step, "metrics": plain_metrics, "extra": dict(extra or {}),
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "process_count": jax.process_count(), "mesh": _mesh_of(state.params),
            "has_data_state": data_state is not None}
    items.to_json(meta, "extra")
    self._remember_metric(step, plain_metrics)  # retention runs inside manager.save
    args = ocp.args.Composite(**{items.STATE: ocp.args.StandardSave(state),
                                 items.DATA: items.ProcessJsonSave(data_json),
                                 items.META: ocp.args.JsonSave(meta)})
    saved = self._manager.save(step, args=args, force=True)
    if saved:
      _info_once("checkpoint: saving step %d to %s", step, self.directory)
      self._writing = (step, time.monotonic())
    return bool(saved)

  def copy_to_host_early(self, state: TrainState) -> int:
    """Starts the device-to-host copies that `save(..., state)` waits for, so they run while the
    caller does something else first (the loop: the eval before the save at the same step).
    Returns how many started. Why: the lent v5e copies chip -> host at 0.5-0.8 GB/s, and the
    final save of distill_qwen3.py's ~7 GB state is most of the 13 s after its last eval.

    Only the shards orbax copies as they are: it saves an array held once (no two devices hold
    the same part: every array of a one-chip run) shard by shard, asking each `shard.data` for
    its host copy (copy_to_host_async, then np.asarray), so its request finds this copy under way
    and reads it. A replicated array orbax splits over its replicas: left to the save."""
    started = 0
    for x in jax.tree.leaves(state):
      if isinstance(x, jax.Array) and _held_once(x):
        for shard in x.addressable_shards:
          shard.data.copy_to_host_async()
          started += 1
    return started

  def set_aside_steps_after(self, step: int, reason: str = "rolled-back") -> list[int]:
    """Renames every step newer than `step` to `<n>.<reason>-<time>` (kept on disk, no longer a
    step), e.g. after a rollback to `step`: otherwise a later resume would pick the abandoned
    trajectory's newer steps, and re-saving those step numbers would be refused."""
    self.wait()
    newer = [s for s in self.all_steps() if s > int(step)]
    for s in newer:
      self._move_aside(s, reason)
    return newer

  def wait(self) -> None:
    """Blocks until every started save is committed (and raises if one failed)."""
    self._manager.wait_until_finished()
    self._manager.check_for_errors()
    self._log_written()

  def close(self) -> None:
    if not self._closed:
      self._manager.wait_until_finished()
      self._log_written()
      self._manager.close()
      self._closed = True

  def _log_written(self) -> None:
    """How long the last save took to commit: at a run's end the user waits for it (on the lent
    v5e the copies off the chip are most of it)."""
    if self._writing is not None:
      step, started = self._writing
      self._writing = None
      _info_once("checkpoint: step %d committed %.1f s after its save started", step,
                 time.monotonic() - started)

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- restore ------------------------------------------------------------------------------

  def restore(self, step: int | None = None, *, abstract_state: TrainState,
              shardings: Any = None) -> tuple[TrainState, Any, dict]:
    """(state, data_state, meta) of `step` (default: the latest), read onto `shardings`.

    `abstract_state` gives shapes and dtypes (`StateLayout.abstract`); `shardings` the target
    placement: a tree like the state (`StateLayout.shardings`), one Sharding for all leaves, or
    None for shardings already on the abstract leaves. Raises CorruptCheckpointError for a step
    that cannot be read and UserError when the checkpoint holds a different model.
    `data_state` is None if none was saved, or (with a warning) if the checkpoint was written by
    a different number of processes, whose data positions do not map onto this run's.
    """
    self.wait()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise UserError(f"no checkpoint in {self.directory}; train first, or point the workdir "
                        f"at a run that saved checkpoints")
    step = int(step)
    if step not in self.all_steps():
      raise UserError(f"no checkpoint for step {step} in {self.directory}; available steps: "
                      f"{self.all_steps()}")
    target = items.restore_target(abstract_state, shardings)
    step_dir = self.step_dir(step)
    items.check_step_items(step_dir, step)
    items.check_saved_tree(step_dir, step, target)
    args = ocp.args.Composite(**{items.STATE: ocp.args.StandardRestore(target),
                                 items.DATA: items.ProcessJsonRestore(),
                                 items.META: ocp.args.JsonRestore()})
    try:
      restored = self._manager.restore(step, args=args)
      state, data, meta = (restored[items.STATE], restored[items.DATA], restored[items.META])
      if not isinstance(meta, dict):
        raise ValueError(f"metadata is {type(meta).__name__}, not a JSON object")
    except UserError:
      raise
    except Exception as e:  # noqa: BLE001 - I/O and decoding failures of a step are corruption
      raise CorruptCheckpointError(step, str(self.directory), items.short_problem(e)) from e
    data_state = self._data_state(step, data)
    _info_once("checkpoint: restored step %d from %s (saved on mesh %s by %s process(es))", step,
               self.directory, meta.get("mesh"), meta.get("process_count"))
    return state, data_state, meta

  def restore_latest_valid(self, *, abstract_state: TrainState,
                           shardings: Any = None) -> tuple[TrainState, Any, dict] | None:
    """Like `restore` of the newest readable step; None when there is none (a fresh start).

    A corrupt or incomplete step is skipped with a WARNING naming it and the problem, left on
    disk, and remembered so that retention never deletes it. On several processes the steps
    are tried in lockstep and one that fails on any process is skipped by all.
    """
    for step in reversed(self.all_steps()):
      problem = None
      try:
        out = self.restore(step, abstract_state=abstract_state, shardings=shardings)
      except CorruptCheckpointError as e:
        problem, out = e.problem, None
      if jax.process_count() > 1:
        ok_all = multihost_utils.process_allgather(np.asarray(problem is None, np.int32))
        if problem is None and not np.all(ok_all):
          problem = "it could not be read on another process"
      if problem is None:
        return out
      self._invalid_steps.add(step)
      log.warning("checkpoint step %d in %s is incomplete or corrupt (%s); skipping it and trying "
                  "the previous step. The directory is left in place.", step, self.directory,
                  problem)
    return None

  def restore_arrays(self, target: Mapping[str, Any]) -> tuple[int, Any]:
    """(step, arrays) of the newest readable step, reading only the arrays `target` names.

    `target` is a subtree of the saved state as nested dicts of ShapeDtypeStructs carrying
    their target shardings, e.g. {"params": ...}: an orbax partial restore, so asking for a
    student's weights reads no teacher, optimizer or RNG array. A step that cannot be read is
    skipped with a warning, as in `restore_latest_valid`.
    """
    self.wait()
    target = items.restore_target(target, None)
    args = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    for step in reversed(self.all_steps()):
      try:
        items.check_step_items(self.step_dir(step), step)
        with ocp.PyTreeCheckpointer() as reader:
          arrays = reader.restore(self.step_dir(step) / items.STATE, args=args)
        _info_once("checkpoint: restored step %d from %s (%s only)", step, self.directory,
                   ", ".join(sorted(target)))
        return step, arrays
      except CorruptCheckpointError as e:
        problem = e.problem
      except Exception as e:  # noqa: BLE001 - an unreadable step is skipped, as on resume
        problem = items.short_problem(e)
      log.warning("checkpoint step %d in %s cannot be read (%s); trying the previous step",
                  step, self.directory, problem)
    raise UserError(f"no readable checkpoint in {self.directory}; train the run to a checkpoint "
                    f"first")

  # ---- internals ----------------------------------------------------------------------------

  def _data_state(self, step: int, data: items.ProcessJsonResult) -> Any:
    if data.found:
      return data.value
    log.warning("checkpoint step %d holds data-iterator state for other process counts (%s) but "
                "this run has %d process(es): the data pipeline restarts from its beginning",
                step, ", ".join(data.saved_files), jax.process_count())
    return None

  def _remember_metric(self, step: int, metrics: Mapping[str, float]) -> None:
    value = metrics.get(self.best_metric)
    if value is not None and math.isfinite(value):
      self._metric_by_step[step] = self._sign * value

  def _load_metric(self, step: int) -> None:
    """Reads a step's metric from its metadata JSON; an unreadable one ranks as no metric."""
    path = self.step_dir(step) / items.META / items.META_FILENAME
    try:
      meta = json.loads(path.read_text())
      self._remember_metric(step, _plain_metrics(meta.get("metrics")))
    except Exception as e:  # noqa: BLE001 - a damaged step must not stop the run from starting
      log.info("checkpoint step %d: no readable metrics (%s: %s)", step, type(e).__name__, e)

  def _move_aside(self, step: int, reason: str) -> None:
    """Renames a step out of the way (never deletes it): orbax no longer lists it as a step."""
    src = self.step_dir(step)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    dst = self.directory / f"{step}.{reason}-{stamp}"
    if jax.process_index() == self.primary_host:
      log.warning("checkpoint step %d in %s (%s) moved to %s, not deleted, so that step %d can be "
                  "saved again", step, self.directory, reason, dst, step)
      src.rename(dst)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"distillax_checkpoint_move_aside_{step}_{reason}")
    self._invalid_steps.discard(step)
    self._metric_by_step.pop(step, None)
    self._manager.reload()


def _held_once(x: jax.Array) -> bool:
  """No two devices hold the same part of `x` (its shards are as many as its devices)."""
  return len(x.sharding.device_set) * math.prod(x.sharding.shard_shape(x.shape)) == math.prod(
      x.shape)
