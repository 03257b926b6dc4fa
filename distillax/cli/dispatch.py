"""Which job each command runs: JOBS maps a command to a function of (the resolved config, the
command's flag values with paths already absolute, and `config_overrides`: the `--config.*`
values the user set) that returns the exit status. Each job imports
its module only when it runs, so a command loads (and compiles) only what it needs, and nothing
here imports JAX before main.py has handled `--devices`.
"""

from __future__ import annotations

import os
import sys


def _train(config, flags: dict) -> int:
  """0 when the run finished (now or earlier); STOPPED_EXIT_CODE when a signal (SIGTERM, Ctrl-C)
  stopped it first, with a checkpoint to resume from; INTERRUPTED_EXIT_CODE when Ctrl-C came
  before anything was saved (cli/interrupted.py)."""
  import jax
  from absl import logging

  from distillax.cli.extend import schedule_note
  from distillax.cli.interrupted import interrupted
  from distillax.errors import UserError
  from distillax.framework.run.preemption import STOPPED_EXIT_CODE
  from distillax.trainers import Trainer, recipe_for
  workdir = flags["workdir"]
  if not workdir:
    raise UserError("--workdir is required for train, e.g. --workdir runs/my_run")
  where = os.path.abspath(workdir)
  try:
    recipe = recipe_for(config, workdir=workdir, model_overrides=flags["config_overrides"])
    note = schedule_note(where, recipe.config)
    if note and jax.process_index() == 0:
      logging.warning("%s", note)
    summary = Trainer(recipe, workdir).run()
  except KeyboardInterrupt:  # outside the steps (compiling, say); between steps Ctrl-C saves
    line, code = interrupted("train", where)
    print(line, file=sys.stderr, flush=True)
    return code
  step, total = summary.get("step"), int(config.train.steps)
  if summary.get("already_finished"):
    line, code = f"already finished at step {step}; workdir {where}", 0
  elif summary.get("finished"):
    early = " (early stop: train.early_stop_evals)" if summary.get("early_stopped") else ""
    line, code = f"done at step {step}{early}; workdir {where}", 0
  else:
    line = f"stopped at step {step} of {total}; rerun the same command to resume"
    code = STOPPED_EXIT_CODE
  if jax.process_index() == 0:
    print(f"distillax train: {line}", flush=True)
  return code


def _plan(config, flags: dict) -> int:
  from distillax.errors import UserError
  if flags["target"] is None:
    if flags["slices"] is not None or flags["nodes"] is not None or flags["search"]:
      raise UserError("--slices, --nodes and --search size a --target; add one, e.g. "
                      "--target tpu:v5e-4")
    from distillax.plan.local import run_plan
    return run_plan(config, devices=flags["devices"], memory_gb=flags["memory_gb"],
                    model_overrides=flags["config_overrides"])
  if flags["devices"] is not None:
    raise UserError(f"--devices={flags['devices']} simulates CPU devices, --target="
                    f"{flags['target']} compiles for the target's own; drop --devices")
  from distillax.plan.target import run_target_plan
  return run_target_plan(config, flags["target"], slices=flags["slices"], nodes=flags["nodes"],
                         memory_gb=flags["memory_gb"], search=flags["search"],
                         model_overrides=flags["config_overrides"])


def _export(config, flags: dict) -> int:
  from distillax.export import run_export
  return run_export(config, flags["workdir"], flags["output"], flags["format"], flags["quant"],
                    model_overrides=flags["config_overrides"])


def _cache_teacher(config, flags: dict) -> int:
  from distillax.cache_teacher import run_cache_teacher
  return run_cache_teacher(config, flags["workdir"], kind=flags["kind"],
                           model_overrides=flags["config_overrides"])


def _demo(config, flags: dict) -> int:
  from distillax.demo import run_demo
  return run_demo(config, flags["workdir"])


def _generate(config, flags: dict) -> int:
  from distillax.generate import run_generate
  return run_generate(config, flags["model"], prompt=flags["prompt"], messages=flags["messages"],
                      max_new_tokens=flags["max_new_tokens"], temperature=flags["temperature"],
                      top_k=flags["top_k"], top_p=flags["top_p"], seed=flags["seed"],
                      full_precision=flags["full_precision"])


def _eval(config, flags: dict) -> int:
  """The exact eval loss; with --tasks, lm-eval tasks; with --generate, BLEU / chrF / ROUGE-L
  of greedy completions; with --against, fidelity to a full-precision twin."""
  from distillax.errors import UserError
  chosen = [f"--{k}" for k in ("tasks", "against", "generate", "draft")
            if flags[k] is not None]
  if len(chosen) > 1:
    raise UserError(f"{' and '.join(chosen)} are separate evaluations; run one at a time")
  if chosen:
    import jax
    if jax.process_count() > 1:
      raise UserError(f"eval {chosen[0]} runs in one process; launch it without --num_processes")
  if flags["draft"] is not None:
    from distillax.eval.draft import run_eval_draft
    return run_eval_draft(config, flags["draft"], flags["model"], proposals=flags["proposals"],
                          max_new_tokens=flags["max_new_tokens"],
                          temperature=flags["temperature"])
  for name in ("proposals",):
    if flags[name] is not None:
      raise UserError(f"--{name} sets how --draft runs; add --draft DIR")
  if str(flags["model"] or "").endswith(".gguf") and flags["generate"] is None and (
      flags["against"] is None):
    raise UserError(f"--model {flags['model']} is a GGUF file, which eval runs in llama.cpp with "
                    f"--generate FILE or --against RUN; for --tasks or the eval loss give the run "
                    f"or Hugging Face directory it was exported from")
  if flags["tasks"] is not None:
    from distillax.eval.lm_tasks import run_eval_tasks
    return run_eval_tasks(config, flags["model"], flags["tasks"], num_fewshot=flags["num_fewshot"],
                          limit=flags["limit"], output=flags["output"])
  for name in ("num_fewshot", "limit", "output"):
    if flags[name] is not None:
      raise UserError(f"--{name} sets how --tasks run; add --tasks, e.g. --tasks distillax_code_mc")
  if flags["generate"] is not None:
    from distillax.eval.generate import run_eval_generate
    return run_eval_generate(config, flags["model"], flags["generate"],
                             max_new_tokens=flags["max_new_tokens"])
  if flags["against"] is not None:
    from distillax.eval.against import run_eval_against
    return run_eval_against(config, flags["model"], flags["against"])
  from distillax.eval.loss import run_eval
  return run_eval(config, flags["model"], model_overrides=flags["config_overrides"])


def _expert_load(config, flags: dict) -> int:
  from distillax.expert_load import run_expert_load
  return run_expert_load(config, flags["model"], json_path=flags["json"],
                         keep_top=flags["keep_top"], batches=flags["batches"],
                         model_overrides=flags["config_overrides"])


JOBS = {"train": _train, "plan": _plan, "export": _export, "cache-teacher": _cache_teacher,
        "demo": _demo, "generate": _generate, "eval": _eval, "expert-load": _expert_load}
