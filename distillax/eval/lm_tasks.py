"""`distillax eval --tasks`: lm-evaluation-harness tasks on a run or a Hugging Face directory.

  distillax eval --model runs/kd --tasks distillax_code_mc,distillax_code_gen --limit 8
  distillax eval --model runs/kd --tasks my_task.yaml --output results.json

Every task runs through `eval.harness.DistillaxLM` (distillax's forward and sampler) under
lm-eval's own `simple_evaluate`, and the task metrics print as one JSON object (task -> metric
-> value). A task is one of:

- a task shipped in distillax/eval/tasks/ (runs offline: its data is a JSONL file beside it);
- a task YAML file: the offline route for any data set, e.g. `dataset_path: json` with
  `dataset_kwargs: {data_files: {test: my_data.jsonl}}` (relative paths are read from the
  YAML's folder);
- any lm-eval task name (hellaswag, wikitext, ...), whose data lm-eval downloads (or finds in
  the Hugging Face cache). Indexing lm-eval's ~15k built-in tasks takes seconds, so only a name
  that is neither of the above does.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

import jax

from distillax.errors import UserError
from distillax.eval.hub_data import check_task_data

LOCAL_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")
_NEEDS = "needs the eval extra (lm-eval): pip install 'distillax[eval]'"


def _local_yamls() -> dict[str, str]:
  """Task name -> YAML path of the tasks shipped in tasks/ (the file is named after it)."""
  out = {}
  for folder, _, files in os.walk(LOCAL_TASKS):
    for name in files:
      if name.endswith(".yaml"):
        out[name[:-5]] = os.path.join(folder, name)
  return out


def _yaml_task(path: str) -> dict:
  """The task config of a YAML file, its local data files made absolute from its folder."""
  from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval's own reader: include, !function
  try:
    config = load_yaml(path)
  except Exception as e:  # yaml's and lm-eval's errors alike
    raise UserError(f"--tasks: {path} is not a readable task YAML ({e}); fix it") from None
  if not isinstance(config, dict) or "task" not in config:
    raise UserError(f"--tasks: {path} has no 'task:' name; a task YAML names its task")
  files = (config.get("dataset_kwargs") or {}).get("data_files")
  if files is not None:
    here = os.path.dirname(os.path.abspath(path))
    absolute = lambda f: f if os.path.isabs(f) or "://" in f else os.path.join(here, f)
    if isinstance(files, dict):
      files = {k: ([absolute(f) for f in v] if isinstance(v, list) else absolute(v))
               for k, v in files.items()}
    else:
      files = [absolute(f) for f in files] if isinstance(files, list) else absolute(files)
    config["dataset_kwargs"] = dict(config["dataset_kwargs"], data_files=files)
  return config


def task_specs(tasks: str) -> tuple[list, object]:
  """(what simple_evaluate takes as tasks, its TaskManager) for a comma-separated --tasks."""
  from lm_eval.tasks import TaskManager
  names = [t.strip() for t in (tasks or "").split(",") if t.strip()]
  if not names:
    raise UserError("--tasks is empty; name lm-eval tasks, e.g. --tasks distillax_code_mc")
  local = _local_yamls()
  specs, others = [], []
  for name in names:
    if name in local:
      specs.append(_yaml_task(local[name]))
    elif name.endswith((".yaml", ".yml")):
      if not os.path.isfile(name):
        raise UserError(f"--tasks={name}: no such file; give a task YAML's path or a task name")
      specs.append(_yaml_task(name))
    else:
      others.append(name)
  manager = TaskManager(include_defaults=bool(others))
  unknown = [n for n in others if n not in manager.all_tasks]
  if unknown:
    raise UserError(f"--tasks={','.join(unknown)}: no such lm-eval task; the local ones are "
                    f"{', '.join(sorted(local))}, or give a task YAML file")
  return specs + others, manager


def _metrics(results: dict) -> dict:
  """task -> {metric: value}: lm-eval's numbers, 'N/A' and NaN left out (strict JSON)."""
  out = {}
  for task, values in results.get("results", {}).items():
    kept = {k.replace(",none", ""): v for k, v in values.items()
            if k != "alias" and isinstance(v, (int, float)) and not
            (isinstance(v, float) and not math.isfinite(v))}
    out[task] = kept
  return out


@contextlib.contextmanager
def _no_provenance_probes():
  """simple_evaluate records the git commit of the current directory by running `git describe`
  with the terminal as its stderr: outside a repository the user reads "fatal: not a git
  repository". distillax keeps only the metrics, so lm-eval's probe answers None meanwhile, and
  the environment report it adds to its results (torch's collect_env: `pip list` and other
  subprocesses, ~0.35 s a call) is not gathered."""
  from lm_eval import evaluator
  probe, env_info = evaluator.get_git_commit_hash, evaluator.add_env_info
  evaluator.get_git_commit_hash = lambda: None
  evaluator.add_env_info = lambda results: None
  try:
    yield
  finally:
    evaluator.get_git_commit_hash, evaluator.add_env_info = probe, env_info


def run_tasks(loaded, tasks: str, *, num_fewshot: int | None = None, limit: int | None = None,
              output: str | None = None, batch_size: int = 8) -> dict:
  """Runs lm-eval's simple_evaluate over `loaded` (a generate.LoadedModel); the metrics."""
  try:
    from lm_eval import simple_evaluate
  except ImportError:
    raise UserError(f"--tasks {_NEEDS}") from None
  from distillax.eval.harness import DistillaxLM
  if limit is not None and limit < 1:
    raise UserError(f"--limit={limit} must be at least 1 (documents per task)")
  if num_fewshot is not None and num_fewshot < 0:
    raise UserError(f"--num_fewshot={num_fewshot} must be >= 0")
  if output and os.path.exists(output) and not os.path.isfile(output):
    raise UserError(f"--output={output} is a directory; give a .json file to write")
  specs, manager = task_specs(tasks)
  check_task_data(tasks, specs, manager)
  try:
    with _no_provenance_probes():
      results = simple_evaluate(model=DistillaxLM(loaded, batch_size=batch_size), tasks=specs,
                                task_manager=manager, num_fewshot=num_fewshot, limit=limit,
                                log_samples=False, bootstrap_iters=0)
  except (FileNotFoundError, ConnectionError, OSError) as e:
    raise UserError(f"--tasks={tasks}: a task's data could not be loaded ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); offline, give a task YAML "
                    f"over a local JSON file (dataset_path: json, dataset_kwargs.data_files)"
                    ) from None
  metrics = _metrics(results)
  if output and jax.process_index() == 0:
    with open(output, "w", encoding="utf-8") as f:
      json.dump(metrics, f, indent=1, sort_keys=True, allow_nan=False)
  return metrics


def run_eval_tasks(config, model_dir: str | None, tasks: str, **options) -> int:
  """Prints the task metrics as one JSON object; 0."""
  from distillax.generate import load_model_dir
  try:
    import lm_eval  # noqa: F401
  except ImportError:
    raise UserError(f"--tasks {_NEEDS}") from None
  loaded = load_model_dir(model_dir, config)
  loaded.command = "eval"
  metrics = run_tasks(loaded, tasks, **options)
  if jax.process_index() == 0:
    print(json.dumps(metrics, sort_keys=True, allow_nan=False), flush=True)
  return 0
