"""The training loop: init or resume, steps, eval, checkpoints, metrics, preemption, rollback.

It runs whatever a recipe builds and knows nothing of distillation or quantization. Everything a
user relies on to trust a run lives here once: a workdir that belongs to one job (workdir.py),
exact resume from the newest valid checkpoint (state, data position, RNG and the open metrics
window), a checkpoint on SIGTERM or Ctrl-C, metrics one step late so logging never stalls the
device, rollback to the best checkpoint when the watched eval figure (`train.rollback_metric`,
lower or higher is better: framework/eval_rules.py) worsens past its threshold or the loss stops
being finite, and an early stop when that figure has not improved for `train.early_stop_evals`
evals (the run then counts as finished). Throughput counts train steps
only: eval, checkpoint saves and rollbacks are paused out of it. A rollback marks the abandoned
rows of metrics.jsonl (framework/run/writers.py) and writes a row of its own.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
from absl import logging

from distillax import interrupts
from distillax import partitioning as pt
from distillax.data import iterator_state_json, restore_iterator_state
from distillax.errors import UserError
from distillax.framework.run import compile_cache, runtime
from distillax.framework.run.checkpoint import Checkpointer
from distillax.framework.eval_rules import HIGHER, ROLLBACK, STOP, EvalGuard
from distillax.framework.evaluation import evaluate
from distillax.framework.run.memory import check_step_fits
from distillax.trainers.eval_ahead import compile_first_eval
from distillax.trainers.loop_tools import Tools, log_first_step, make_tools
from distillax.trainers.recipe import Engines, Recipe, check_recipe_data
from distillax.trainers.saved import SOURCES_KEY, check_fingerprints, check_sources_unchanged
from distillax.trainers.workdir import (check_not_foreign, check_workdir, check_writable,
                                        lock_workdir, open_checkpointer, prepare_workdir,
                                        release_workdir, write_summary)


@dataclasses.dataclass
class _Run:
  """What changes as a run goes: the state, where it is, and what rollback needs."""
  state: Any
  step: int
  train_it: Any
  guard: EvalGuard  # rollback and early stop on train.rollback_metric (framework/eval_rules.py)
  rollbacks: int = 0
  last_eval: dict = dataclasses.field(default_factory=dict)
  eval_step: int | None = None  # the step last_eval is of
  window: dict | None = None  # the open metrics window the restored checkpoint carried
  data_state: Any = None  # the data position a rollback restored
  early_stopped: bool = False  # train.early_stop_evals ended the run before train.steps

  @property
  def metric(self) -> str:
    return self.guard.metric

  @property
  def meta(self) -> dict:
    return {"rollbacks": self.rollbacks, "rollback_metric": self.metric,
            "best": self.guard.best, "stale_evals": self.guard.stale}

  def resume_guard(self, extra: dict) -> None:
    """The guard's best and stale count from a checkpoint's metadata (none when it was kept for
    another figure; checkpoints from before train.rollback_metric kept eval perplexity)."""
    metric = extra.get("rollback_metric", "eval_perplexity")
    if metric == self.metric:
      self.guard.best = extra.get("best", extra.get("best_eval_perplexity"))
      self.guard.stale = int(extra.get("stale_evals", 0))


class Trainer:
  """Runs `recipe` in `workdir`: `Trainer(recipe_for(config), workdir).run()`."""

  def __init__(self, recipe: Recipe, workdir: str):
    self.recipe, self.config = recipe, recipe.config
    self.workdir = os.path.abspath(workdir)
    self.primary = runtime.is_primary()
    self.engines: Engines | None = None
    self._stepped = False  # this session trained a step (a failure then keeps the workdir's)
    self.fingerprints: dict = {}  # of the sources reloaded on resume, recorded in every save

  def run(self) -> dict[str, Any]:
    """Trains to `train.steps`; returns the summary (also written to summary.json, at every end
    of a session: `ended` says which, `reason` why when it failed), whose `finished` is False
    when a signal stopped the run first. A workdir this job already finished is left as it is:
    its summary comes back with `already_finished` True.

    The workdir is locked first (process 0 takes it for the job's processes), so another
    process's job, or this one submitted twice, is refused before anything compiles; a session
    that ends before its first step leaves a fresh workdir as it found it."""
    lock = lock_workdir(self.workdir, primary=self.primary)
    workdir_state, failed = None, True
    try:
      # Another job's workdir fails first, before any work; then every config, data and shape
      # error surfaces, before the workdir is touched.
      workdir_state = check_workdir(self.workdir, self.config)
      if workdir_state.finished:
        failed = False
        return {**workdir_state.summary, "already_finished": True}
      if workdir_state.changes and self.primary:
        logging.warning("resuming %s with the same job computed another way: %s", self.workdir,
                        "; ".join(workdir_state.changes))
      check_recipe_data(self.recipe)
      check_writable(self.workdir)
      interrupts.check()
      self.recipe.startup.mark("checks")
      # Every program the run compiles is kept in <workdir>/compile_cache: a resume reads them.
      with compile_cache.in_workdir(self.workdir):
        summary = self._run(workdir_state)
      failed = False
      return summary
    finally:
      fresh_failure = failed and not self._stepped
      if fresh_failure and self.primary:
        release_workdir(workdir_state)  # nothing trained, nothing saved: not this job's yet
      if lock is not None:
        lock.release(remove_made=fresh_failure)

  def _run(self, workdir_state) -> dict[str, Any]:
    c, startup = self.config, self.recipe.startup
    self.engines = self.recipe.build_engines()  # lowered; each step compiles in the background
    startup.mark("step lowering")
    train_it = self.recipe.train_iterator()
    self.fingerprints = check_sources_unchanged(self.workdir, self.recipe,
                                                self.engines.main.layout)
    guard = EvalGuard(self.recipe.rollback_metric, float(c.train.rollback_threshold),
                      int(c.train.get("early_stop_evals", 0)))
    check_not_foreign(workdir_state)  # after the config's own errors, before checkpoints/
    ckpt = open_checkpointer(self.workdir, c.checkpoint, guard.metric,
                             higher_is_better=guard.direction == HIGHER)
    compile_first_eval(self.recipe, self.engines, ckpt.latest_step() or 0)  # beside the step's
    startup.mark("data")
    try:
      run = self._start_and_claim(ckpt, train_it, guard, workdir_state)
    except BaseException:
      ckpt.close()
      raise
    tools = make_tools(self.recipe, self.workdir, self.primary, run.step, run.window)
    startup.mark("metrics")
    self._log_plan()
    # summary.json is written however the session ends (_summary), except when it failed
    # before its first step: a fresh workdir is then left free.
    first, failure = run.step, None
    try:
      self._train(run, ckpt, tools)
    except BaseException as e:
      failure = e
      raise
    finally:
      total = int(c.train.steps)
      tools.close(run.state, ckpt, finished=failure is None and (
          run.step >= total or run.early_stopped))
      summary = _summary(run, total, tools, failure)
      self._stepped = failure is None or run.step != first
      if self._stepped and self.primary:  # else run() leaves a fresh workdir as it found it
        write_summary(self.workdir, summary)
    return summary

  def _start_and_claim(self, ckpt: Checkpointer, train_it, guard: EvalGuard,
                       workdir_state) -> _Run:
    """The run's first state (models created while the step compiles), then, once the compiled
    step is known to fit the memory left, the workdir made this job's (job.json, config.json).
    A failure before the first step leaves a fresh workdir free for the corrected command."""
    startup = self.recipe.startup
    interrupts.check()
    run = self._start(ckpt, train_it, guard)
    startup.mark("models" if run.step == 0 else "restore")
    interrupts.check()
    runner = self.engines.at(run.step).runner.wait()
    startup.mark("waiting for the step's compile")
    check_step_fits(runner.stats)
    prepare_workdir(workdir_state, self.config, primary=self.primary)
    startup.mark("memory and workdir")
    return run

  def _train(self, run: _Run, ckpt: Checkpointer, tools: Tools) -> None:
    total, eval_every = int(self.config.train.steps), int(self.config.train.eval_every)
    tokens = self.recipe.batch_size * self.recipe.seq_len
    first = run.step
    while run.step < total:
      tools.profile.step(run.step, block_on=run.state)
      runner = self.engines.at(run.step).runner
      batch = next(run.train_it)
      if run.step == first:
        self.recipe.startup.mark("first batch")
      run.state, metrics = runner(run.state, runner.place_batch(batch))
      run.step += 1
      if run.step == first + 1:
        log_first_step(self.recipe, runner, metrics, run.step, self.primary)
      row = tools.logger.record(run.step, metrics)
      loss = row.get("loss") if row else None
      tools.progress.update(tokens=tokens, loss=loss)
      bad_loss = loss is not None and not math.isfinite(loss)
      if bad_loss or (eval_every and run.step % eval_every == 0) or run.step == total:
        if not bad_loss and (run.step == total or ckpt.should_save(run.step)):
          ckpt.copy_to_host_early(_stored(self.engines.main, run.state))  # beside the eval
        tools.logger.pause(block_on=run.state)  # eval and rollback are not step time
        verdict = self._eval_point(run, ckpt, tools, loss if bad_loss else None)
        tools.logger.resume()
        if verdict == ROLLBACK:
          tools.logger.restore_window(run.window)
          continue  # rolled back: run.step is the restored step
        run.early_stopped = verdict == STOP and run.step < total
      if ckpt.should_save(run.step) or run.step == total or run.early_stopped:
        tools.logger.pause(block_on=run.state)
        # Only this step's own eval ranks its checkpoint (the best one is where rollback goes).
        self._save(run, ckpt, tools,
                   metrics=run.last_eval if run.eval_step == run.step else None)
        tools.logger.resume()
      if run.early_stopped:
        logging.warning("early stop at step %d: %s has not improved on %.4g for %d evals "
                        "(train.early_stop_evals)", run.step, run.metric, run.guard.best,
                        run.guard.stale)
        break
      if tools.guard.should_stop(run.step):
        logging.warning("stop requested: saving step %d of %d and stopping", run.step, total)
        self._save(run, ckpt, tools)
        break

  def _eval_point(self, run: _Run, ckpt: Checkpointer, tools: Tools, bad_loss) -> str:
    """Evaluates (unless the loss is already not finite) and judges the watched figure: rolls
    back when the run diverged; the guard's verdict (eval_rules CONTINUE, ROLLBACK or STOP)."""
    tools.logger.flush()
    try:
      run.last_eval = {} if bad_loss is not None else self._evaluate(run.state, run.step)
    except Exception as e:
      # The step is saved first, so the steps since the last checkpoint are not lost to an
      # eval's error, and a user's error says so.
      self._save(run, ckpt, tools)
      if isinstance(e, UserError):
        raise type(e)(f"{e} (step {run.step} was saved before this eval: the same command "
                      f"resumes from it)") from None
      raise
    run.eval_step = run.step
    if run.last_eval:
      tools.logger.write(run.step, run.last_eval)
      if tools.progress.enabled:  # the metric rows' console line is off while the bar shows
        tools.progress.log(f"step {run.step}: eval objective "
                           f"{run.last_eval['eval_objective']:.4f}, next-token loss "
                           f"{run.last_eval['eval_loss']:.4f}"
                           + (f", {run.metric} {run.last_eval[run.metric]:.4g}"
                              if run.metric not in ("eval_objective", "eval_loss") else ""))
    value = run.last_eval.get(run.metric, math.nan)
    best = run.guard.best
    verdict = ROLLBACK if bad_loss is not None else run.guard.judge(value)
    if verdict == ROLLBACK:
      reason = (f"train loss {bad_loss}" if bad_loss is not None
                else f"{run.metric} {value:.4g} vs best {best:.4g}"
                if best is not None and math.isfinite(value) else f"{run.metric} {value}")
      self._rollback(ckpt, run, tools, reason,
                     diverged=bad_loss is not None or not math.isfinite(value))
      run.guard.rolled_back()
      tools.progress.count = run.step
    return verdict

  def _evaluate(self, state, step: int) -> dict[str, float]:
    return evaluate(self.engines.at(step), state, self.recipe.eval_iterator())

  def _save(self, run: _Run, ckpt: Checkpointer, tools: Tools, metrics=None) -> None:
    """Saves the step with the open metrics window; the finished windows' rows are written
    first, so a run killed after this save resumes with every row up to this step on disk."""
    tools.logger.flush()
    extra = {**run.meta, "metrics_window": tools.logger.window_state(),
             SOURCES_KEY: self.fingerprints}
    ckpt.save(run.step, _stored(self.engines.main, run.state),
              data_state=iterator_state_json(run.train_it),
              metrics=metrics, extra=extra, force=True)

  # ---- set-up -------------------------------------------------------------------------------

  def _start(self, ckpt: Checkpointer, train_it, guard: EvalGuard) -> _Run:
    """A fresh state, or the newest valid checkpoint's (with its data position and the
    learning rate of its rollbacks)."""
    engine = self.engines.main
    layout = engine.layout
    restored = ckpt.restore_latest_valid(abstract_state=layout.stored_abstract,
                                         shardings=layout.stored_shardings)
    if restored is not None:  # an older step than the one checked up front: check it too
      check_fingerprints(restored[2], self.fingerprints, self.workdir)
    student, extras = self.recipe.build(abstract=False)
    if restored is None:
      return _Run(engine.init_state(student, extras, int(self.config.seed)), 0, train_it, guard)
    stored, data_state, meta = restored
    logging.info("resuming from step %d (frozen models reloaded from their sources)",
                 int(meta.get("step", -1)))
    extra = dict(meta.get("extra") or {})
    state = engine.restored_state(stored, student, extras)
    step = int(jax.device_get(self.engines.main.runner.fetch_state(state).step))
    run = _Run(state, step, train_it, guard, rollbacks=int(extra.get("rollbacks", 0)),
               window=extra.get("metrics_window"))
    run.resume_guard(extra)
    if run.rollbacks:
      self.engines = self.recipe.build_engines(_scaled_lr(self.config, run.rollbacks))
    if data_state is not None:
      restore_iterator_state(train_it, data_state)
    return run

  def _rollback(self, ckpt: Checkpointer, run: _Run, tools: Tools, reason: str, *,
                diverged: bool) -> None:
    """Restores the best checkpoint and continues with a smaller learning rate; marks the
    abandoned rows of metrics.jsonl and writes the rollback's own row (one line on the console
    too). Past train.max_rollbacks, a UserError whose advice fits the cause."""
    c = self.config
    if run.rollbacks >= int(c.train.max_rollbacks):
      lr = _scaled_lr(self.config, run.rollbacks)
      advice = (f"lower optimizer.learning_rate (the last try ran at {lr:.3g})" if diverged else
                f"{run.metric} worsened more than train.rollback_threshold="
                f"{float(c.train.rollback_threshold):g} over its best: lower "
                f"optimizer.learning_rate (the last try ran at {lr:.3g}), or raise "
                f"train.rollback_threshold if that figure is noisy")
      raise Diverged(f"training diverged at step {run.step} ({reason}) after {run.rollbacks} "
                      f"rollbacks; {advice}, or raise train.max_rollbacks")
    ckpt.wait()
    from_step = run.step
    run.rollbacks += 1
    self.engines = self.recipe.build_engines(_scaled_lr(self.config, run.rollbacks))
    self._restore_best(ckpt, run)
    scale = float(c.train.rollback_lr_factor) ** run.rollbacks
    message = (f"rollback {run.rollbacks} at step {from_step} ({reason}): back to step "
               f"{run.step}, learning rate x{scale:g}")
    logging.warning("%s", message)
    if tools.progress.enabled:
      tools.progress.log(message)
    tools.logger.rolled_back(from_step, run.step, {"rollbacks": run.rollbacks,
                                                    "learning_rate_scale": scale})
    run.train_it = self.recipe.train_iterator()
    if run.data_state is not None:
      restore_iterator_state(run.train_it, run.data_state)

  def _restore_best(self, ckpt: Checkpointer, run: _Run) -> None:
    """run.state, step, window and data position from the best checkpoint by run.metric (a
    fresh state when there is none)."""
    engine = self.engines.main
    layout, run.data_state, run.window = engine.layout, None, None
    best_step = ckpt.best_step()
    if best_step is None and not ckpt.all_steps():
      student, extras = self.recipe.build(abstract=False)
      run.state, run.step = engine.init_state(student, extras, int(self.config.seed)), 0
      return
    stored, run.data_state, meta = ckpt.restore(best_step, abstract_state=layout.stored_abstract,
                                                shardings=layout.stored_shardings)
    # The frozen models are the ones already in memory: nothing is reloaded.
    frozen = engine.runner.fetch_state(run.state).frozen
    state = layout.reloaded.joined(stored, jax.device_put(frozen, layout.shardings.frozen))
    run.state, run.step = engine.runner.place_state(state), int(meta["step"])
    run.window = (meta.get("extra") or {}).get("metrics_window")
    # Newer steps belong to the diverged trajectory: set aside (not deleted) so a later resume
    # cannot pick them up.
    ckpt.set_aside_steps_after(run.step)

  def _log_plan(self) -> None:
    if not self.primary:
      return
    engine = self.engines.main
    n_params = sum(int(x.size) for x in jax.tree.leaves(engine.layout.abstract.params))
    stats = engine.runner.stats
    logging.info("%s: %d trainable params, mesh %s, strategy %s, backend %s; per-device arguments "
                 "%s, temporaries %s", self.recipe.name, n_params,
                 pt.mesh_shape_str(self.recipe.mesh), self.recipe.rules.name,
                 engine.runner.backend,
                 pt.shard.format_bytes(stats.get("argument_size_in_bytes", 0)),
                 pt.shard.format_bytes(stats.get("temp_size_in_bytes", 0)))


class Diverged(UserError):
  """Training diverged past train.max_rollbacks: summary.json ends "diverged"."""


def _stored(engine, state):
  """What a checkpoint of `state` holds (not the frozen models its sources give back)."""
  return engine.layout.reloaded.stored(engine.runner.fetch_state(state))


def _scaled_lr(c, rollbacks: int) -> float:
  return float(c.optimizer.learning_rate) * float(c.train.rollback_lr_factor) ** rollbacks


def _summary(run: _Run, total: int, tools: Tools, failure: BaseException | None) -> dict:
  """summary.json: where the session ended and `ended`, how: finished (train.steps),
  early_stopped (train.early_stop_evals), stopped (a signal; the step is saved), diverged (out
  of rollbacks), interrupted (Ctrl-C outside the steps) or failed, with the error as
  `reason` for the last three."""
  if failure is None:
    ended = ("early_stopped" if run.early_stopped else "finished" if run.step >= total
             else "stopped")
  else:
    ended = ("diverged" if isinstance(failure, Diverged) else
             "interrupted" if isinstance(failure, KeyboardInterrupt) else "failed")
  summary = {"step": run.step, "total_steps": total,
             "finished": ended in ("finished", "early_stopped"), "ended": ended,
             "rollbacks": run.rollbacks, **(tools.logger.latest or {}), **run.last_eval}
  if failure is not None:
    summary["reason"] = str(failure) or type(failure).__name__
  if run.early_stopped:
    summary["early_stopped"] = True
  return summary
