"""What a job's config may hold, checked before anything is built, with every problem a check
can see in one message.

Two checks, because they can see different things:
- `check_run_sections`, when a recipe is made: values no run can use (a negative train.steps,
  an on_policy.top_p of 0), each named by the key the user sets, with a good value.
- `check_recipe_data`, before anything compiles: what the config asks of its model and data
  (train.seq_len against model.max_seq_len, the warmup against train.steps, a split with no
  token to train, a bad record, the prompts of its `prompt_splits`: on-policy prompts that
  on_policy.prompt_len cannot hold, train and held-out; the GGUF layout the trained student
  will need). A user whose config conflicts with a small model and 20 chats in three ways
  learns all three from one run, not from three reruns.
"""

from __future__ import annotations

import math

import jax

from distillax.data.sources import resolve_files
from distillax.data.survey import check_data
from distillax.edge.arch_checks import gguf_architecture
from distillax.errors import ConfigError, UserError
from distillax.framework import optim
from distillax.models.attention import tokamax as attention_tokamax
from distillax.models.moe import kernels as moe_kernels

# (section, field, smallest allowed value, an example of a good value). Checked when a recipe is
# made, so a value no run can use fails in one line naming it, not steps later in what it breaks
# (a negative train.steps used to surface as a complaint about the warmup).
_LIMITS = (("train", "steps", 1, 200), ("train", "batch_size", 1, 16),
           ("train", "seq_len", 1, 128), ("train", "accum_steps", 1, 1),
           ("train", "log_every", 1, 10), ("train", "eval_every", 0, 50),
           ("train", "eval_batches", 1, 8), ("train", "rollback_threshold", 0, 0.05),
           ("train", "max_rollbacks", 0, 2), ("train", "early_stop_evals", 0, 3),
           ("checkpoint", "every_steps", 0, 100),
           ("checkpoint", "keep", 1, 2), ("checkpoint", "keep_best", 0, 1))

# (section, field, test, what it must be, a good value) of fractional fields. The on_policy ones
# are checked here, by the names the user sets, rather than where they end up (a sampler's
# `temperature`, which is another on_policy field; GeneralizedJSD.beta; a top_p of None, which
# the command line cannot give).
_RANGES = (
    ("train", "rollback_lr_factor", lambda v: 0 < v <= 1,
     "in (0, 1]: the learning rate is scaled by it after a rollback;", 0.5),
    ("on_policy", "sampling_temperature", lambda v: v >= 0, "0 (greedy) or more,", 1.0),
    ("on_policy", "top_k", lambda v: v >= 0, "0 (off) or more,", 0),
    ("on_policy", "top_p", lambda v: 0 < v <= 1, "in (0, 1] (1 = off),", 1.0),
    ("on_policy", "beta", lambda v: 0 <= v <= 1,
     "in [0, 1] (0 forward KL, 1 reverse KL, 0.5 the symmetric JSD),", 0.5),
    ("on_policy", "temperature", lambda v: v > 0,
     "more than 0 (1.0 compares the models' own distributions),", 1.0),
    ("on_policy", "lmbda", lambda v: 0 <= v <= 1,
     "in [0, 1] (the share of steps on the student's own samples),", 1.0))


def one_error(problems: list[str]) -> ConfigError | None:
  """One error for every problem found (None for none): the problem itself when alone, else
  each numbered in one line."""
  if not problems:
    return None
  if len(problems) == 1:
    return ConfigError(problems[0])
  listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
  return ConfigError(f"{len(problems)} problems, all to fix before this job can run: {listed}")


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def section_problems(config) -> list[str]:
  """The train, checkpoint, optimizer and on_policy values no run can use."""
  out = []
  for section, key, least, example in _LIMITS:
    value = config[section].get(key, example) if section in config else example
    if not (isinstance(value, (int, float)) and value >= least):  # NaN fails this too
      out.append(f"{section}.{key}={value!r} must be {least} or more, e.g. "
                 f"--config.{section}.{key}={example}")
  for section, key, ok, must, example in _RANGES:
    if section in config and key in config[section]:
      value = config[section][key]
      if not (_is_number(value) and ok(value)):
        out.append(f"{section}.{key}={value!r} must be {must} e.g. "
                   f"--config.{section}.{key}={example}")
  try:
    optim.check_optimizer_config(config.optimizer)
  except ConfigError as e:
    out.append(str(e))
  return out


def check_run_sections(config) -> None:
  """Refuses train, checkpoint, optimizer and on_policy values no run can use, all in one
  message, before any mesh, data or compile."""
  error = one_error(section_problems(config))
  if error is not None:
    raise error


def check_data_paths(data) -> None:
  """A data source that names no files fails when the recipe is made, not after compiling."""
  for key in ("source", "eval_source"):
    spec = str(data.get(key, "") or "")
    if spec and spec != "stdlib":
      try:
        resolve_files(spec)
      except UserError as e:
        raise ConfigError(f"data.{key}: {e}") from None


def model_conflicts(recipe, *, routed=None) -> list[str]:
  """What the config asks that its model (or its own run length) cannot give. `routed`: (model
  config, its name) of the model a job other than training runs the batches through
  (expert-load's teacher), whose positions are checked instead of the student's."""
  out = []
  cfg = recipe.config
  position = _positions_conflict(recipe, routed)
  if position:
    out.append(position)
  try:
    optim.make_schedule(cfg.optimizer, int(cfg.train.steps))
  except ConfigError as e:  # the warmup outlasts the run, an unknown schedule
    out.append(str(e))
  out += _vmap_moe_conflicts(recipe)
  out += _tokamax_conflicts(recipe)
  return out


def _positions_conflict(recipe, routed=None) -> str | None:
  """train.seq_len past the positions of the model the batches run through, and what may be
  raised: model.max_seq_len of a fresh student; a student with weights from a source (teacher
  blocks, a checkpoint, a run) has the source's, which no model.* flag changes."""
  L = recipe.seq_len
  if routed is not None:
    cfg, name = routed
    if L <= cfg.max_seq_len:
      return None
    return (f"train.seq_len={L} exceeds the max_seq_len={cfg.max_seq_len} of {name}, the model "
            f"the batches are routed through; lower it (e.g. --config.train.seq_len="
            f"{cfg.max_seq_len})")
  limit, source = recipe.model_config.max_seq_len, recipe.sources.student
  if L <= limit:
    return None
  if source.kind == "fresh":
    return (f"train.seq_len={L} exceeds model.max_seq_len={limit}; lower the first (e.g. "
            f"--config.train.seq_len={limit}) or raise the second")
  longer = ("a teacher of more positions (its max_seq_len)" if source.kind == "teacher"
            else "a source of more positions")
  return (f"train.seq_len={L} exceeds the student's max_seq_len={limit}, which comes with "
          f"{source.named()} (model.max_seq_len cannot change a shape its source gives); lower "
          f"train.seq_len (e.g. --config.train.seq_len={limit}), or derive the student from "
          f"{longer}")


def _tokamax_conflicts(recipe) -> list[str]:
  """moe_impl='tokamax' or attention_impl='tokamax' without the optional package: named before
  anything compiles. Whether it is installed is asked only then: the question imports tokamax
  (about 1.5 s of CPU), which a job that does not use it should not pay at every start."""
  models = [mc for mc in (recipe.model_config, recipe.teacher_model_config) if mc is not None]
  out = []
  if any(mc.num_experts and mc.moe_impl == "tokamax" for mc in models):
    out.append(moe_kernels.TOKAMAX_MISSING)
  if any(mc.attention_impl == "tokamax" for mc in models):
    out.append(attention_tokamax.TOKAMAX_MISSING)
  return out if out and not moe_kernels.tokamax_installed() else []


def _vmap_moe_conflicts(recipe) -> list[str]:
  """jax.lax.ragged_dot (the ragged MoE dispatch) has no batching rule over the vmap backend's
  worker axis: name the fix instead of failing inside the compile."""
  if recipe.config.get("backend") != "vmap":
    return []
  models = [("model", recipe.model_config), ("teacher", recipe.teacher_model_config)]
  out = []
  for name, mc in models:
    if mc is not None and mc.num_experts and mc.moe_impl in ("ragged", "tokamax"):
      fix = ("or --config.model.moe_impl=dense" if name == "model"
             else "(the teacher's experts run ragged)")
      out.append(f"backend='vmap' cannot batch the {name}'s {mc.moe_impl} expert matmul "
                 f"(jax.lax.ragged_dot); use --config.backend=shard_map or pmap {fix}")
  return out


def check_model_conflicts(recipe) -> None:
  """Refuses a config its model cannot run, every conflict in one message (what compiling a
  job's step checks first; training checks its data with them, check_recipe_data)."""
  error = one_error(model_conflicts(recipe))
  if error is not None:
    raise error


EXPORT_FORMATS = ("", "gguf", "hf")


def export_problems(recipe) -> list[str]:
  """The GGUF export the trained student will need (train.export_format='gguf': the demo's
  stages, a job headed for llama.cpp), refused before anything trains when llama.cpp would run
  it otherwise (edge/arch_checks.py, what `distillax export --format gguf` asks). Nothing is
  said of other jobs (QAT in q4_0/q8_0 included: fake-quantizing to llama.cpp's formats does
  not say the job ends there): a warning at every start of every MoE or derived student was
  noise before the one line of a real error."""
  fmt = str(recipe.config.train.get("export_format", "") or "")
  if fmt not in EXPORT_FORMATS:
    return [f"train.export_format={fmt!r} is not an export format; use gguf, hf or '' (none "
            f"checked), e.g. --config.train.export_format=gguf"]
  try:
    gguf_architecture(recipe.model_config)
  except UserError as e:
    if fmt == "gguf":
      return [f"train.export_format='gguf', but this student cannot be exported as GGUF: {e}"]
  return []


def check_recipe_data(recipe, *, routed=None) -> None:
  """Reads every record of a recipe's data once, before anything compiles: a bad record or a
  split with no token to train (recipe.data_splits) is named in one message with every
  conflict between the config and its model, not a failure (or a wait) steps in. `routed`:
  as model_conflicts."""
  problems = model_conflicts(recipe, routed=routed) + _source_file_problems(recipe)
  try:
    check_data(recipe.config.data, recipe.tokenizer, process_count=jax.process_count(),
               splits=recipe.data_splits)
  except UserError as e:
    problems.append(str(e))
  for split in recipe.prompt_splits:
    try:
      recipe.prompts(split)
    except UserError as e:
      problems.append(str(e))
  problems += export_problems(recipe)
  error = one_error(problems)
  if error is not None:
    raise error


def _source_file_problems(recipe) -> list[str]:
  """A weight file a source lacks (a safetensors shard, say), found before the step compiles
  rather than when the models are created beside its compile (issue 55: 13-18 s here)."""
  problems = []
  for source in (recipe.sources.student, recipe.sources.teacher, recipe.teacher_source):
    try:
      if source is not None:
        source.check_files()
    except UserError as e:
      if str(e) not in problems:
        problems.append(str(e))
  return problems
