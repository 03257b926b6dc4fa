"""`distillax eval`: the exact eval loss and perplexity of a run or a Hugging Face model.

  distillax eval --model runs/kd
  distillax eval --model out/kd_hf --config distillax/configs/lm.py \
      --config.data.tokenizer=hf:out/kd_hf --config.data.eval_source=val.jsonl

The numbers are the trainer's own: the job's recipe gives the eval batches (`train.eval_batches`
batches of the validation split, or of data.eval_source) and the eval objective, and
`framework.evaluation.evaluate` (the trainer's and the demo report's route too) sums every real
token's loss before dividing once, so a finished run's summary.json eval_loss, and a demo
stage's row of report.json, come back exactly. A run is evaluated under its own config.json at
its newest valid checkpoint; with --config, on that config's data section and eval sizes
(train.batch_size, seq_len, eval_batches) instead. A Hugging Face directory needs --config: the
job it is evaluated as, with the directory's weights as the student (as train.init_from would
start it). Prints one JSON object (eval_objective: the job's objective; eval_loss and
eval_perplexity: next-token CE and its exp, whatever the objective; eval_tokens and the
objective's metrics) on stdout, and on stderr one line naming the form the student was evaluated in (a QAT
job's fake-quant forward from qat.start_step on, LoRA adapters on: the training forward).
"""

from __future__ import annotations

import json
import sys

import jax

from distillax.errors import UserError
from distillax.framework.evaluation import evaluate

_EVAL_SIZES = ("batch_size", "seq_len", "eval_batches")


def run_recipe(model_dir: str, config=None):
  """The recipe of the run in `model_dir` as it is evaluated: its own config.json, with
  `config` (when given) supplying the data section, eval sizes, mesh and partitioning."""
  from distillax.trainers import recipe_for
  from distillax.trainers.sources import as_loaded, load_run_config
  cfg = as_loaded(load_run_config(model_dir, "--model"), keep_data=True)
  if config is not None:
    cfg.data = config.data.copy_and_resolve_references()
    for key in _EVAL_SIZES:
      cfg.train[key] = config.train[key]
    cfg.mesh, cfg.partitioning = config.mesh, config.partitioning
  return recipe_for(cfg, workdir=model_dir)


def restore_onto(recipe, engines, model_dir: str):
  """(engine, state) of `model_dir`'s newest valid checkpoint on the layout of `engines` (of
  `recipe`, which rebuilds the frozen models that came from a source): the engine is the one
  of the checkpoint's step (before a delayed QAT start, the full-precision one). The demo
  report also restores one run's weights onto another run's engines (PTQ: the fp student
  under the QAT stage's engine)."""
  from distillax.trainers import restore_run_state
  state = restore_run_state(model_dir, recipe, engines.main)
  step = int(jax.device_get(engines.main.runner.fetch_state(state).step))
  return engines.at(step), state


def _run_job(config, model_dir: str, model_overrides=None):
  """(recipe, engine, state, form) of a run at its newest valid checkpoint (its own model
  section: no override applies to it)."""
  del model_overrides
  recipe = run_recipe(model_dir, config)
  engine, state = restore_onto(recipe, recipe.build_engines(compile_now=False), model_dir)
  step = int(jax.device_get(engine.runner.fetch_state(state).step))
  form = recipe.transforms.at_step(step).describe(
      fake_quant=recipe.transforms.fake_quant_at(step), lora_merged=False)
  return recipe, engine, state, f"{form}; checkpoint step {step}"


def _hf_job(config, model_dir: str, model_overrides=None):
  """(recipe, engine, state, form) of `config`'s job with the checkpoint's weights as the
  student."""
  from distillax.trainers import hf_checkpoint_recipe
  recipe = hf_checkpoint_recipe(config, model_dir, model_overrides=model_overrides,
                                purpose="to evaluate it under (its data and objective)")
  engine = recipe.build_engines(compile_now=False).main
  student, extras = recipe.build(abstract=False)
  form = recipe.transforms.describe(fake_quant=True, lora_merged=False)
  state = engine.init_state(student, extras, int(recipe.config.seed))
  return recipe, engine, state, f"{form} (a Hugging Face checkpoint)"


def evaluate_model(config, model_dir: str, *, model_overrides=None) -> dict[str, float]:
  """The eval metrics of `model_dir` (a run or a Hugging Face directory), as the trainer
  computes them."""
  from distillax.trainers.sources import is_hf_checkpoint
  if not model_dir:
    raise UserError("--model is required: a run's --workdir or a Hugging Face checkpoint "
                    "directory, e.g. --model runs/kd")
  job = _hf_job if is_hf_checkpoint(model_dir) else _run_job
  recipe, engine, state, form = job(config, model_dir, model_overrides)
  if jax.process_index() == 0:
    print(f"distillax eval: {model_dir} evaluated as {form}", file=sys.stderr, flush=True)
  return evaluate(engine, state, recipe.eval_iterator())


def run_eval(config, model_dir: str | None, *, model_overrides=None) -> int:
  """Prints the metrics as one JSON object; 0."""
  metrics = evaluate_model(config, model_dir, model_overrides=model_overrides)
  if jax.process_index() == 0:
    print(json.dumps(metrics, sort_keys=True), flush=True)
  return 0
