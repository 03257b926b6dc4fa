"""The training loop: init or resume, steps, eval, checkpoints, metrics, preemption, rollback.

Subclasses contribute only what differs between jobs: the models (`build_models`), the objective
and which parameters train (`trainable`). Everything a user relies on to trust a run lives here
once: exact resume from the newest valid checkpoint (state, data position and RNG), a checkpoint
on SIGTERM, metrics one step late so logging never stalls the device, and rollback to the best
checkpoint when eval perplexity jumps or the loss stops being finite.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import jax
from absl import logging
from flax import nnx

from distillax import partitioning as pt
from distillax.data import (check_vocab, iterator_state_json, make_eval_iterator,
                            make_train_iterator, make_tokenizer, padded_vocab_size,
                            restore_iterator_state)
from distillax.errors import ConfigError, UserError
from distillax.framework import flops, runtime
from distillax.framework.checkpoint import Checkpointer
from distillax.framework.engine import Engine, build_engine
from distillax.framework.metrics import MetricLogger
from distillax.framework.preemption import PreemptionGuard
from distillax.framework.profiling import ProfileWindow
from distillax.framework.progress import ProgressBar
from distillax.framework.step import Objective
from distillax.framework.throughput import Throughput, peak_flops_per_device
from distillax.framework.writers import create_writers
from distillax.models.config import TransformerConfig
from distillax.models.init import abstract_model, create_model

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "checkpoints"


def resolve_model_config(model_cfg, tokenizer) -> TransformerConfig:
  """The model's TransformerConfig with the vocabulary taken from, or checked against, data."""
  values = dict(model_cfg)
  if int(values.get("vocab_size") or 0) <= 0:
    values["vocab_size"] = padded_vocab_size(tokenizer)
  cfg = TransformerConfig.from_dict(values)
  check_vocab(tokenizer, cfg.vocab_size)
  return cfg


def place_module(module: nnx.Module, mesh, rules) -> nnx.Module:
  """Puts every variable of `module` on the mesh by its logical axes (for parts created after
  the sharded init: adapters, projections)."""
  graph, state = nnx.split(module)
  values = nnx.to_pure_dict(state)
  shardings = pt.tree_shardings(values, pt.logical_tree(state), mesh, rules)
  return nnx.merge(graph, jax.device_put(values, shardings))


class Trainer:
  """Next-token training of one model. Subclass hooks: build_models, objective, trainable."""

  name = "lm"

  def __init__(self, config, workdir: str):
    self.config = config
    self.workdir = os.path.abspath(workdir)
    self.primary = runtime.is_primary()

  # ---- hooks ---------------------------------------------------------------------------------

  def objective(self) -> Objective:
    from distillax.trainers.lm import lm_objective
    return lm_objective

  def trainable(self) -> Any:
    """Only LoRA adapters train under `lora.rank > 0`; otherwise every parameter."""
    if self.lora_enabled:
      from distillax.quant import LoRAParam
      return LoRAParam
    return nnx.Param

  @property
  def lora_enabled(self) -> bool:
    return bool(self.config.get("lora") and self.config.lora.module_regex)

  @property
  def qat_enabled(self) -> bool:
    return bool(self.config.get("qat") and self.config.qat.rules)

  def transform_student(self, model: nnx.Module, *, quantize: bool = True) -> nnx.Module:
    """LoRA/QLoRA adapters and QAT fake quantization, from the `lora` and `qat` sections.

    The state tree is the same with and without fake quantization, so a delayed QAT start
    (`qat.start_step`) swaps compiled steps without touching the state.
    """
    from distillax import quant
    if self.lora_enabled:
      lc = self.config.lora
      model = quant.apply_lora(model, module_regex=lc.module_regex, rank=int(lc.rank),
                               alpha=float(lc.alpha), dropout=float(lc.dropout),
                               base_qtype=lc.base_qtype or None,
                               base_tile_size=(int(lc.base_tile_size) or None) if lc.base_qtype
                               else None,
                               seed=int(self.config.seed))
    if quantize and self.qat_enabled:
      qc = self.config.qat
      model = quant.quantize_for_training(model, {"rules": [tuple(r) for r in qc.rules],
                                                  "start_step": int(qc.start_step)})
    return model

  def build_models(self, mesh, rules, *, abstract: bool,
                   quantize: bool = True) -> tuple[nnx.Module, dict]:
    """(student, frozen extras). Abstract modules cost no memory; real ones are sharded.
    quantize=False leaves QAT fake quantization off (the steps before `qat.start_step`)."""
    return self.build_student_model(mesh, rules, abstract=abstract, quantize=quantize), {}

  def build_student_model(self, mesh, rules, *, abstract: bool,
                          quantize: bool = True) -> nnx.Module:
    """Fresh weights, or those of an earlier run when `train.init_from` names its workdir,
    then LoRA / QAT as configured. Abstract modules hold shapes only."""
    cfg, init_from = self.model_config, self.config.train.get("init_from", "")
    if abstract:
      return nnx.eval_shape(lambda: self.transform_student(
          abstract_model(cfg, self.config.seed), quantize=quantize))
    if init_from:
      from distillax.trainers.loading import load_trained_model
      model = load_trained_model(init_from, mesh, rules)
      if model.config != cfg:
        raise ConfigError(f"train.init_from={init_from} holds a model of another shape "
                          f"({model.config}); make the model section match it")
    else:
      model = create_model(cfg, mesh=mesh, rules=rules, seed=self.config.seed)
    return place_module(self.transform_student(model, quantize=quantize), mesh, rules)

  def export_model(self, student: nnx.Module) -> nnx.Module:
    """The plain deployable model inside the trained student: wrappers and training-only parts
    off, LoRA merged, fake quantization stripped (quantized export applies it again)."""
    from distillax import quant
    from distillax.distill.student import unwrap_student
    model = unwrap_student(student)[0]
    if self.lora_enabled:
      model = quant.merge_lora(model)
    if self.qat_enabled:
      model = quant.full_precision(model)
    return model

  def teacher_config(self) -> TransformerConfig | None:
    """Counted in the FLOPs of a step (forward only) when a teacher runs inside it."""
    return None

  # ---- set-up --------------------------------------------------------------------------------

  def prepare_workdir(self) -> None:
    """Creates the workdir and writes config.json; runs only after the config validated."""
    try:
      os.makedirs(self.workdir, exist_ok=True)
      if not os.access(self.workdir, os.W_OK):
        raise PermissionError(13, "Permission denied")
    except OSError as e:
      raise UserError(f"workdir {self.workdir} is not writable ({e.strerror}); pass --workdir "
                      f"pointing to a directory you can write") from None
    if self.primary:
      tmp = os.path.join(self.workdir, CONFIG_FILE + ".tmp")
      with open(tmp, "w") as f:
        f.write(self.config.to_json_best_effort(indent=2, sort_keys=True))
      os.replace(tmp, os.path.join(self.workdir, CONFIG_FILE))

  def setup(self, *, with_data: bool = True) -> None:
    """Mesh, rules, model config and the compiled step (and the data pipeline, when asked)."""
    c = self.config
    self.mesh = pt.create_mesh(c.mesh)
    self.rules = pt.rules_from_config(c.partitioning)
    self.tokenizer = make_tokenizer(c.data.tokenizer)
    self.model_config = resolve_model_config(c.model, self.tokenizer)
    self.batch_size, self.seq_len = int(c.train.batch_size), int(c.train.seq_len)
    if self.seq_len > self.model_config.max_seq_len:
      raise ConfigError(f"train.seq_len={self.seq_len} exceeds model.max_seq_len="
                        f"{self.model_config.max_seq_len}; lower the first or raise the second")
    self._build_engines(float(c.optimizer.learning_rate))
    self.train_it = self._train_iterator() if with_data else None

  def _train_iterator(self):
    c = self.config
    return make_train_iterator(c.data, global_batch_size=self.batch_size, seq_len=self.seq_len,
                               seed=int(c.seed), tokenizer=self.tokenizer)

  def _build_engines(self, learning_rate: float) -> None:
    """The compiled step; with a delayed QAT start also the full-precision one used before it."""
    self.engine = self._build_engine(learning_rate)
    delayed = self.qat_enabled and int(self.config.qat.start_step) > 0
    self.engine_fp = self._build_engine(learning_rate, quantize=False) if delayed else None

  def engine_at(self, step: int) -> Engine:
    if self.engine_fp is not None and step < int(self.config.qat.start_step):
      return self.engine_fp
    return self.engine

  def _build_engine(self, learning_rate: float, quantize: bool = True) -> Engine:
    c = self.config
    optimizer_cfg = c.optimizer.copy_and_resolve_references()
    optimizer_cfg.learning_rate = learning_rate
    student, extras = self.build_models(self.mesh, self.rules, abstract=True, quantize=quantize)
    runtime.per_process_batch(self.batch_size)
    local = self.batch_size // jax.process_count()
    shapes = {k: jax.ShapeDtypeStruct((self.batch_size, self.seq_len), v.dtype)
              for k, v in self._batch_dtypes(local).items()}
    objective = self.objective()
    train_objective = objective
    if self.lora_enabled and float(c.lora.dropout) > 0:
      from distillax.quant import with_lora_dropout
      train_objective = with_lora_dropout(objective)
    return build_engine(student, extras, train_objective, optimizer_cfg, int(c.train.steps),
                        self.mesh, self.rules, c.backend, shapes,
                        accum_steps=int(c.train.accum_steps), trainable=self.trainable(),
                        eval_objective=objective,
                        gradient_reduction=str(c.partitioning.get("gradient_reduction", "auto")))

  def _batch_dtypes(self, local: int) -> Mapping[str, Any]:
    import numpy as np
    from distillax.data import padding_rows
    return padding_rows(1, 1, 0) if local else {"inputs_BxL": np.zeros((1, 1), np.int32)}

  def _throughput(self) -> Throughput:
    teacher = self.teacher_config()
    model_flops = flops.train_step_flops(self.model_config, self.batch_size, self.seq_len,
                                         teacher_cfg=teacher)["total"]
    peak, source = peak_flops_per_device()
    logging.info("MFU peak per device: %s", source)
    return Throughput(self.batch_size * self.seq_len, model_flops, jax.device_count(), peak)

  # ---- the run -------------------------------------------------------------------------------

  def init_or_restore(self, ckpt: Checkpointer):
    layout = self.engine.layout
    restored = ckpt.restore_latest_valid(abstract_state=layout.abstract, shardings=layout.shardings)
    if restored is not None:
      state, data_state, meta = restored
      logging.info("resuming from step %d", int(meta.get("step", -1)))
      return self.engine.runner.place_state(state), data_state, dict(meta.get("extra") or {})
    student, extras = self.build_models(self.mesh, self.rules, abstract=False)
    return self.engine.init_state(student, extras, self.config.seed), None, {}

  def evaluate(self, state) -> dict[str, float]:
    c = self.config
    batches = make_eval_iterator(c.data, global_batch_size=self.batch_size, seq_len=self.seq_len,
                                 num_batches=int(c.train.eval_batches), tokenizer=self.tokenizer)
    return self.engine_at(int(jax.device_get(self.engine.runner.fetch_state(state).step))
                          ).evaluate(state, batches)

  def run(self) -> dict[str, float]:
    c = self.config
    self.setup()  # every config/data/shape error surfaces here, before the workdir is touched
    ckpt = self._checkpointer()
    self.prepare_workdir()
    total_steps = int(c.train.steps)
    state, data_state, extra = self.init_or_restore(ckpt)
    start = int(jax.device_get(self.engine.runner.fetch_state(state).step))
    rollbacks = int(extra.get("rollbacks", 0))
    best = extra.get("best_eval_perplexity")
    if rollbacks:
      self._build_engines(self._scaled_lr(rollbacks))
    train_it = self.train_it
    if data_state is not None:
      restore_iterator_state(train_it, data_state)
    writers = create_writers(self.workdir, is_primary=self.primary, resume_step=start,
                             console=not c.train.progress)
    logger = MetricLogger(writers, log_every=int(c.train.log_every),
                          throughput=self._throughput())
    guard = PreemptionGuard()
    profile = ProfileWindow(self.workdir, max(int(c.profile.start_step), 0),
                            int(c.profile.num_steps) if int(c.profile.start_step) >= 0 else 0,
                            enabled=self.primary)
    progress = ProgressBar(total_steps, desc=self.name, initial=start,
                           enabled=bool(c.train.progress) and self.primary)
    self._log_plan()
    eval_every = int(c.train.eval_every)
    last_eval: dict[str, float] = {}
    step = start
    try:
      while step < total_steps:
        profile.step(step, block_on=state)
        batch = next(train_it)
        runner = self.engine_at(step).runner
        state, metrics = runner(state, runner.place_batch(batch))
        step += 1
        row = logger.record(step, metrics)
        loss = row.get("loss") if row else None
        progress.update(tokens=self.batch_size * self.seq_len, loss=loss)
        bad_loss = loss is not None and not math.isfinite(loss)
        if bad_loss or (eval_every and step % eval_every == 0) or step == total_steps:
          logger.flush()
          last_eval = {} if bad_loss else self.evaluate(state)
          if last_eval:
            logger.write(step, last_eval)
          if last_eval and self.primary:
            progress.log(f"step {step}: eval objective {last_eval['eval_loss']:.4f}, "
                         f"next-token perplexity {last_eval['eval_perplexity']:.3f}")
          ppl = last_eval.get("eval_perplexity", math.inf)
          limit = (best or math.inf) * (1 + float(c.train.rollback_threshold))
          if bad_loss or not math.isfinite(ppl) or ppl > limit:
            state, train_it, step, rollbacks = self._rollback(ckpt, step, rollbacks, best, loss,
                                                              ppl)
            progress.count = step
            continue
          best = ppl if best is None else min(best, ppl)
        extra_meta = {"rollbacks": rollbacks, "best_eval_perplexity": best}
        if ckpt.should_save(step) or step == total_steps:
          ckpt.save(step, self.engine.runner.fetch_state(state),
                    data_state=iterator_state_json(train_it),
                    metrics=last_eval if last_eval.get("eval_loss") else None, extra=extra_meta,
                    force=True)
          logger.resume_timing()
        if guard.should_stop(step):
          logging.warning("preemption signal: saving step %d and stopping", step)
          ckpt.save(step, self.engine.runner.fetch_state(state),
                    data_state=iterator_state_json(train_it), extra=extra_meta, force=True)
          break
    finally:
      profile.close(block_on=state)
      logger.close()
      progress.close()
      guard.close()
      ckpt.close()
    summary = {"step": step, "finished": step >= total_steps, "rollbacks": rollbacks,
               **(logger.latest or {}), **last_eval}
    if self.primary:
      with open(os.path.join(self.workdir, SUMMARY_FILE), "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    return summary

  def _checkpointer(self) -> Checkpointer:
    c = self.config
    try:
      return Checkpointer(os.path.join(self.workdir, CHECKPOINT_DIR),
                          every_steps=int(c.checkpoint.every_steps),
                          keep_last=int(c.checkpoint.keep), keep_best=int(c.checkpoint.keep_best),
                          best_metric="eval_loss", async_save=bool(c.checkpoint.async_save))
    except OSError as e:
      raise UserError(f"workdir {self.workdir} is not writable ({e.strerror or e}); pass "
                      f"--workdir pointing to a directory you can write") from None

  def _scaled_lr(self, rollbacks: int) -> float:
    c = self.config
    return float(c.optimizer.learning_rate) * float(c.train.rollback_lr_factor) ** rollbacks

  def _rollback(self, ckpt: Checkpointer, step: int, rollbacks: int, best, loss, ppl):
    """Restores the best checkpoint and continues with a smaller learning rate."""
    c = self.config
    reason = (f"loss {loss}" if loss is not None and not math.isfinite(loss)
              else f"eval perplexity {ppl:.4g} vs best {best}")
    if rollbacks >= int(c.train.max_rollbacks):
      raise UserError(f"training diverged at step {step} ({reason}) after {rollbacks} rollbacks; "
                      f"lower optimizer.learning_rate or raise train.max_rollbacks")
    ckpt.wait()
    best_step = ckpt.best_step()
    rollbacks += 1
    self._build_engines(self._scaled_lr(rollbacks))
    layout = self.engine.layout
    if best_step is None and not ckpt.all_steps():
      student, extras = self.build_models(self.mesh, self.rules, abstract=False)
      state, data_state, to_step = self.engine.init_state(student, extras, self.config.seed), None, 0
    else:
      state, data_state, meta = ckpt.restore(best_step, abstract_state=layout.abstract,
                                             shardings=layout.shardings)
      state, to_step = self.engine.runner.place_state(state), int(meta["step"])
      # Newer steps belong to the diverged trajectory: set aside (not deleted) so a later resume
      # cannot pick them up.
      ckpt.set_aside_steps_after(to_step)
    logging.warning("rollback %d at step %d (%s): back to step %d, learning rate x%g", rollbacks,
                    step, reason, to_step, float(c.train.rollback_lr_factor) ** rollbacks)
    train_it = self._train_iterator()
    if data_state is not None:
      restore_iterator_state(train_it, data_state)
    return state, train_it, to_step, rollbacks

  def _log_plan(self) -> None:
    if not self.primary:
      return
    layout = self.engine.layout
    n_params = sum(int(x.size) for x in jax.tree.leaves(layout.abstract.params))
    stats = self.engine.runner.stats
    logging.info("%s: %d trainable params, mesh %s, strategy %s, backend %s; per-device arguments "
                 "%s, temporaries %s", self.name, n_params, pt.mesh_shape_str(self.mesh),
                 self.rules.name, self.engine.runner.backend,
                 pt.shard.format_bytes(stats.get("argument_size_in_bytes", 0)),
                 pt.shard.format_bytes(stats.get("temp_size_in_bytes", 0)))
