"""The workdir contract (DESIGN.md, "Workdir contract"): what a run keeps where, and the only
code that creates or writes its top-level files.

    <workdir>/job.json        the job's identity (see NOT_JOB_IDENTITY), written when it is made
    <workdir>/config.json     the resolved config, written only after every check passed
    <workdir>/metrics.jsonl   one JSON object per logged step (framework/run/writers.py)
    <workdir>/summary.json    final metrics of the run, {"finished": bool, ...}
    <workdir>/checkpoints/    orbax checkpoints
    <workdir>/tensorboard/    TensorBoard event files
    <workdir>/compile_cache/  JAX's persistent compilation cache (framework/run/compile_cache.py)
    <workdir>/lock.json       while a session runs: its lock (framework/run/workdir_lock.py)

A workdir belongs to one job. `check_workdir` compares this config's identity with the one the
workdir holds before anything runs: the same job resumes (or is reported already finished), a
different one is refused with one line and nothing in the workdir changes. A workdir made by an
older distillax (config.json, no job.json) gets its identity from its config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Any

from distillax.errors import UserError
from distillax import jsonio
from distillax.framework.run import runtime
from distillax.framework.run.checkpoint import Checkpointer
from distillax.framework.run.workdir_lock import WorkdirLock
from distillax.models.config import COMPUTE, fields_of_kind

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "checkpoints"
JOB_FILE = "job.json"
# What a session writes into a fresh workdir before its first step; a session that fails or
# is interrupted before that step removes those of them that were not there before it.
SESSION_ENTRIES = (JOB_FILE, CONFIG_FILE, SUMMARY_FILE, CHECKPOINT_DIR, "compile_cache",
                   "tensorboard", "metrics.jsonl", "metrics.rolled_back.jsonl")

# The config fields that do not make a run another job: how long it runs, how it logs and
# evaluates, and where it writes outputs. Rerunning with any of them changed resumes the workdir.
# A name ending in "." is a whole section. This is the one place the list lives.
NOT_JOB_IDENTITY: dict[str, str] = {
    "train.steps": "how long the job runs: raising it continues a finished run",
    "train.log_every": "how often metrics are logged",
    "train.eval_every": "how often the job evaluates (what it trains is the same)",
    "train.eval_batches": "how many validation batches an eval reads",
    "train.progress": "the console progress bar",
    "train.accum_steps": "how a step's batch is split for memory: the same update",
    "mesh.": "where the job runs: a checkpoint restores onto another topology",
    "partitioning.": "how the state is laid out on the devices, not what it holds",
    "backend": "which compiled form of the one step runs: every backend computes the same",
    "checkpoint.": "when checkpoints are written and how many are kept, not what they hold",
    "profile.": "a traced window of steps: tracing changes no result",
    "runtime.": "how the processes find each other, not what they compute",
    "sequence_kd.output": "where the teacher samples are written",
    "cache.": "read by `distillax cache-teacher` only, never by training",
    "eval.": "what each eval also measures (held-out generations), not what trains",
    "teacher.attention_impl": "how the teacher's forward computes: the same model, tested equal",
    "train.export_format": "a check at start of what the trained student will be exported as",
    "train.loss_impl": "how the vocabulary losses are computed: every implementation computes "
                       "the same losses (framework/vocab_slices.py, vocab_chunks.py)",
    # The model fields declared as how the forward computes (models/config.py's field kinds).
    **{f"model.{name}": "how the forward computes: the same model, tested equal"
       for name in fields_of_kind(COMPUTE)},
}
_ABSENT = "<absent>"


def _not_writable(workdir: str, e: OSError) -> UserError:
  return UserError(f"workdir {workdir} is not writable ({e.strerror or e}); pass --workdir "
                   f"pointing to a directory you can write")


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def _not_identity(name: str) -> str | None:
  """Why the dotted config field `name` does not make another job; None when it does."""
  for n, why in NOT_JOB_IDENTITY.items():
    if name == n or (n.endswith(".") and name.startswith(n)):
      return why
  return None


def _identity_of(config_json: dict) -> dict[str, Any]:
  """Every field of a config (as JSON, dotted names) that says which job it is."""
  return {k: v for k, v in _flatten(jsonio.strict(config_json)).items()
          if _not_identity(k) is None}


def job_identity(config) -> dict[str, Any]:
  """The job `config` describes: the resolved config minus NOT_JOB_IDENTITY, in config order."""
  return _identity_of(json.loads(config.to_json_best_effort()))


def _read_json(path: str) -> Any:
  """The parsed file; None when it does not exist; ValueError when it is not JSON."""
  try:
    with open(path) as f:
      return json.load(f)
  except (FileNotFoundError, NotADirectoryError):
    return None
  except OSError as e:
    raise UserError(f"{path} is not readable ({e.strerror or e}); fix its permissions or pass a "
                    f"new --workdir") from None


def _is_run_config(value: Any) -> bool:
  """A config.json some distillax job wrote (every job config and the demo's have these)."""
  return isinstance(value, dict) and "train" in value and ("trainer" in value or "job" in value)


def workdir_job(workdir: str) -> str | None:
  """What the workdir's config.json is: None (there is none), "demo", a trainer name, or ""
  for a config.json that no distillax run wrote."""
  try:
    value = _read_json(os.path.join(workdir, CONFIG_FILE))
  except ValueError:
    return ""
  if value is None:
    return None
  if not _is_run_config(value):
    return ""
  return str(value.get("job") or value.get("trainer"))


@dataclasses.dataclass(frozen=True)
class WorkdirState:
  """What a workdir holds for the job about to run; `check_workdir` makes it, reading only."""
  workdir: str
  has_job_file: bool = False  # job.json is there (else prepare_workdir writes it)
  foreign: bool = False  # a config.json that no distillax run wrote: this job may not take it
  summary: dict | None = None  # summary.json of an earlier session of this job
  finished: bool = False  # that session finished at train.steps or beyond: nothing to train
  # Fields of the model section that differ from the earlier session's config.json without
  # making another job (how the forward computes), each as "name: there -> here (why)".
  changes: tuple[str, ...] = ()
  existing: frozenset = frozenset()  # the names in the workdir before this session


def _stored_identity(workdir: str) -> tuple[dict | None, bool, bool]:
  """(identity, from job.json, foreign): job.json's, else derived from an older config.json."""
  try:
    job = _read_json(os.path.join(workdir, JOB_FILE))
  except ValueError:
    raise UserError(f"{os.path.join(workdir, JOB_FILE)} is not valid JSON; pass a new "
                    f"--workdir (this one's job cannot be told)") from None
  if isinstance(job, dict) and isinstance(job.get("identity"), dict):
    return job["identity"], True, False
  if job is not None:
    raise UserError(f"{os.path.join(workdir, JOB_FILE)} holds no job identity; pass a new "
                    f"--workdir (this one's job cannot be told)")
  try:
    config_json = _read_json(os.path.join(workdir, CONFIG_FILE))
  except ValueError:
    return None, False, True
  if config_json is None:
    return None, False, False
  if not _is_run_config(config_json):
    return None, False, True
  return _identity_of(config_json), False, False


def _short(value: Any) -> str:
  text = value if value == _ABSENT else json.dumps(value)
  return text if len(text) <= 40 else text[:37] + "..."


# Fields added after runs began whose value here asks for nothing an older job did not do (a
# dense model, no router loss): a job.json without them and a config with these values are the
# same job. Fields that are off when None (model.layer_types) need no entry.
ADDED_LATER: dict[str, Any] = {
    "model.num_experts": 0, "model.num_experts_per_tok": 2, "model.moe_mlp_dim": 0,
    "model.router": "softmax_topk", "model.norm_topk_prob": False,
    "model.rope_scaling_type": "llama3", "model.rope_yarn_beta_fast": 32.0,  # gpt-oss's fields
    "model.rope_yarn_beta_slow": 1.0, "model.rope_yarn_truncate": True,
    "model.attn_out_bias": False, "model.attention_sinks": False, "model.router_bias": False,
    "model.expert_bias": False,
    "model.swiglu_alpha": 1.702, "model.swiglu_limit": 7.0,
    "model.linear_num_key_heads": 2, "model.linear_num_value_heads": 4,  # Qwen3.5's fields
    "model.linear_key_head_dim": 16, "model.linear_value_head_dim": 16,
    "model.linear_conv_kernel": 4, "model.partial_rotary_factor": 1.0,
    "model.attn_output_gate": False,
    "model.per_layer_input_dim": 0, "model.per_layer_input_vocab_size": 0,  # Gemma 4's fields
    "model.num_kv_shared_layers": 0, "model.value_norm": False, "model.layer_scalar": False,
    "model.global_head_dim": 0, "model.global_rope_fraction": 1.0,
    "model.double_wide_shared_mlp": False, "model.attention_k_eq_v": False,
    "model.global_num_kv_heads": 0,
    "model.moe_dense_mlp": False,  # Gemma 4 26B's MoE block
    "model.shared_expert_mlp_dim": 0, "model.shared_expert_gate": False,  # Qwen3.5-MoE's
    "model.pre_norms": True, "model.qk_norm_across_heads": False,  # OLMo 3's
    "model.fused_qkv_gate_up": False,  # Phi-3/4's
    "model.fused_qkvz_ba": False,  # Qwen3-Next's
    "model.qk_l2_norm": False, "model.attn_temperature_scale": 0.1,  # Llama 4's
    "model.router_score_bias": False, "model.router_groups": 1,  # DeepSeek V3's router
    "model.router_groups_kept": 1, "model.routed_scaling_factor": 1.0,
    "model.moe_scale_inputs": False,  # Llama 4's
    "train.moe_aux_loss": 0.0, "train.router_z_loss": 0.0,
    "model.splash_blocks": [512, 512, 512], "model.splash_fused_bwd": False,
    "student.from_teacher.experts": [], "distill.router.weight": 0.0,
    "qat.schedule": [],
    "train.early_stop_evals": 0,
    # The draft job's regeneration (off), and the sequence_kd section its config gained with it.
    "draft.regenerate": False, "sequence_kd.num_prompts": 256, "sequence_kd.prompt_len": 32,
    "sequence_kd.max_new_tokens": 96, "sequence_kd.temperature": 1.0, "sequence_kd.top_k": 0,
    "sequence_kd.top_p": 1.0, "sequence_kd.batch_size": 32, "sequence_kd.include_prompt": True,
}


def _asks_for_more(name: str, value: Any) -> bool:
  """Whether a field the stored job lacks asks, with `value`, for something that job did not."""
  return value is not None and (name not in ADDED_LATER or value != ADDED_LATER[name])


def _other_job_error(owner: str, stored: dict, current: dict) -> UserError | None:
  # A field newer than the stored job that this config leaves off (None, or its ADDED_LATER
  # value) asks for nothing the older job did not do: the same job.
  names = [k for k in current if stored.get(k, _ABSENT) != current[k]
           and (k in stored or _asks_for_more(k, current[k]))]
  names += [k for k in stored if k not in current]
  if not names:
    return None
  first = names[0]
  there, here = stored.get(first, _ABSENT), current.get(first, _ABSENT)
  shown = f"{first}: {_short(there)} there, {_short(here)} here"
  if len(names) > 1:
    more = ", ".join(names[1:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    shown += f"; also {more}"
  return UserError(f"{owner} belongs to another job ({shown}); pass a new --workdir for this "
                   f"job, or rerun that job's own command to resume it")


def check_workdir(workdir: str, config, *, owner: str | None = None) -> WorkdirState:
  """Whether `config`'s job may run in `workdir`, reading only: a different job's workdir is a
  UserError naming the first differing fields; the same job's comes back with its summary."""
  workdir = os.path.abspath(workdir)
  stored, has_job_file, foreign = _stored_identity(workdir)
  try:
    existing = frozenset(os.listdir(workdir))
  except OSError:
    existing = frozenset()
  if stored is None:
    return WorkdirState(workdir, foreign=foreign, existing=existing)
  # A job.json written before a field joined NOT_JOB_IDENTITY still holds it: not compared.
  stored = {k: v for k, v in stored.items() if _not_identity(k) is None}
  error = _other_job_error(owner or f"workdir {workdir}", stored, job_identity(config))
  if error is not None:
    raise error
  summary = read_summary(workdir)
  # An early stop (train.early_stop_evals) finishes the job before train.steps.
  finished = bool(summary and summary.get("finished")
                  and (int(summary.get("step") or 0) >= int(config.train.steps)
                       or summary.get("early_stopped")))
  return WorkdirState(workdir, has_job_file, summary=summary, finished=finished,
                      changes=_model_changes(workdir, config), existing=existing)


def _model_changes(workdir: str, config) -> tuple[str, ...]:
  """The model fields outside the job's identity whose value differs from the workdir's
  config.json (what a resume logs); none when that file is missing or unreadable."""
  try:
    earlier = _read_json(os.path.join(workdir, CONFIG_FILE))
  except ValueError:
    return ()
  if not _is_run_config(earlier):
    return ()
  there = _flatten({"model": jsonio.strict(earlier).get("model", {})})
  here = _flatten({"model": json.loads(config.to_json_best_effort()).get("model", {})})
  return tuple(f"{k}: {_short(there.get(k, _ABSENT))} -> {_short(here.get(k, _ABSENT))} "
               f"({_not_identity(k)})" for k in sorted(set(there) | set(here))
               if _not_identity(k) is not None and there.get(k, _ABSENT) != here.get(k, _ABSENT))


def check_writable(workdir: str) -> None:
  """Refuses, before anything compiles, a workdir this process cannot create or write: makes
  the directory, as the compile cache inside it would, writes and removes a probe file there
  (asking the permission bits is not enough: root passes them on /proc), then removes the
  directories it made, so a job refused later still leaves nothing behind."""
  made, parent = [], os.path.abspath(workdir)
  while not os.path.exists(parent):
    made.append(parent)
    parent = os.path.dirname(parent)
  try:
    os.makedirs(workdir, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".distillax-probe-", dir=workdir)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise _not_writable(workdir, e) from None
  finally:
    for folder in made:  # deepest first; only the empty folders this check made
      try:
        os.rmdir(folder)
      except OSError:
        break


def lock_workdir(workdir: str, *, primary: bool = True) -> WorkdirLock | None:
  """The workdir's lock (framework/run/workdir_lock.py), taken before anything reads or writes
  the job there: a second process is refused in one line naming the holder. Process 0 takes it
  for all the job's processes (None on the others), and when it is refused every process ends
  alike (the others with a line pointing to process 0's), not in a collective's timeout."""
  lock, refused = None, None
  if primary:
    try:
      lock = WorkdirLock(workdir)
      lock.acquire(_not_writable)
    except UserError as e:
      lock, refused = None, e
  if not runtime.primary_says(refused is None) and refused is None:
    refused = UserError(f"process 0 could not take the lock of workdir "
                        f"{os.path.abspath(workdir)}; its line says why")
  if refused is not None:
    raise refused
  return lock


def release_workdir(state: WorkdirState | None) -> None:
  """Undoes what a session wrote into a workdir it found fresh (no job.json, no summary) and
  then failed or was interrupted in before its first step (nothing trained, nothing saved):
  the files and folders of SESSION_ENTRIES that were not there before it, so the corrected
  command, another job, may take it, and a refused start leaves nothing behind."""
  if state is None or state.has_job_file or state.summary is not None:
    return
  import shutil
  for name in SESSION_ENTRIES:
    if name in state.existing:
      continue
    path = os.path.join(state.workdir, name)
    if os.path.isdir(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      try:
        os.remove(path)
      except FileNotFoundError:
        pass


def open_checkpointer(workdir: str, checkpoint_cfg, best_metric: str, *,
                      higher_is_better: bool = False) -> Checkpointer:
  """The run's checkpoint manager (`checkpoint` section); keeps the best by `best_metric` too
  (the rollback guard's figure, in its direction: a rollback goes back to the best step by it)."""
  c = checkpoint_cfg
  try:
    return Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), every_steps=int(c.every_steps),
                        keep_last=int(c.keep), keep_best=int(c.keep_best),
                        best_metric=best_metric, async_save=bool(c.async_save),
                        higher_is_better=higher_is_better)
  except OSError as e:
    raise _not_writable(workdir, e) from None


def _write_atomically(path: str, text: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def check_not_foreign(state: WorkdirState) -> None:
  """Refuses a workdir whose config.json no distillax run wrote (this job may not take it)."""
  if state.foreign:
    raise UserError(f"{os.path.join(state.workdir, CONFIG_FILE)} was not written by a "
                    f"distillax run; pass a new --workdir (or an empty directory)")


def prepare_workdir(state: WorkdirState, config, *, primary: bool) -> None:
  """Creates the workdir and writes job.json (once) and config.json (atomically); call it only
  once `check_workdir` and the config, the data and the compiled step have passed every check."""
  workdir = state.workdir
  check_not_foreign(state)
  try:
    os.makedirs(workdir, exist_ok=True)
    if not os.access(workdir, os.W_OK):
      raise PermissionError(13, "Permission denied")
  except OSError as e:
    raise _not_writable(workdir, e) from None
  if primary:
    if not state.has_job_file:
      _write_atomically(os.path.join(workdir, JOB_FILE),
                        jsonio.dumps({"identity": job_identity(config)}, indent=2) + "\n")
    _write_atomically(os.path.join(workdir, CONFIG_FILE),
                      config.to_json_best_effort(indent=2, sort_keys=True))


def write_summary(workdir: str, summary: dict) -> None:
  """summary.json, strict JSON (a value that is not finite is null), replaced atomically."""
  _write_atomically(os.path.join(workdir, SUMMARY_FILE),
                    jsonio.dumps(summary, indent=2, sort_keys=True) + "\n")


def read_summary(workdir: str) -> dict | None:
  """The run's summary.json, or None when the run never ended a session (or it is unreadable:
  the run then resumes from its checkpoints and writes it again)."""
  try:
    summary = _read_json(os.path.join(workdir, SUMMARY_FILE))
  except ValueError:
    return None
  return summary if isinstance(summary, dict) else None
