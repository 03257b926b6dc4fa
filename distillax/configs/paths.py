"""Every path a user writes is relative to the directory the command runs in, made absolute once.

`resolve_job_config` runs where the command line hands its config to a job (main.py), before
anything reads a path: orbax refuses relative checkpoint paths (with a warning lost in the log,
then "no valid checkpoint"), and a relative path kept in a run's config.json would name another
place to a later command started elsewhere. Flags (--workdir, --output, --model) go through
`absolute` there too. PATH_FIELDS is the one list of config fields that hold paths.

A relative path that names nothing there is refused in one line saying what it was resolved
against: the usual cause is a command run from another directory than the one its paths are
relative to, which otherwise surfaced as a traceback wherever the path was first read.
"""

from __future__ import annotations

import glob
import os

from distillax.errors import UserError

# (section, field) of every config value that is a path (a file, a directory or a glob).
PATH_FIELDS = (("train", "init_from"), ("student", "hf_path"), ("teacher", "workdir"),
               ("teacher", "hf_path"), ("teacher", "cache_dir"), ("data", "source"),
               ("data", "eval_source"), ("data", "chat_template"), ("sequence_kd", "output"),
               ("cache", "dir"))
# Those the job writes (they need not exist yet).
_OUTPUT_FIELDS = (("sequence_kd", "output"), ("cache", "dir"))
# Values of those fields that name something other than a path.
_NOT_PATHS = {("data", "source"): ("stdlib",)}
# 'kind:<path>' tokenizer specs ('byte' has no path).
_TOKENIZER_KINDS = ("hf", "spm")


def absolute(path: str | None) -> str | None:
  """`path` from the current directory (with ~ expanded); '' and None stay as they are."""
  if not path:
    return path
  return os.path.abspath(os.path.expanduser(str(path)))


def absolute_tokenizer(spec: str) -> str:
  """'hf:<path>' / 'spm:<path>' with an absolute path; 'byte' and malformed specs unchanged
  (the tokenizer's own check words those)."""
  kind, sep, path = str(spec).partition(":")
  if sep and kind in _TOKENIZER_KINDS and path:
    return f"{kind}:{absolute(path)}"
  return spec


def resolve_paths(config):
  """A copy of `config` whose path fields (those present) are absolute."""
  out = config.copy_and_resolve_references()
  for section, field in PATH_FIELDS:
    if section in out and field in out[section]:
      value = out[section][field]
      if value and value not in _NOT_PATHS.get((section, field), ()):
        out[section][field] = absolute(value)
  if "data" in out and "tokenizer" in out.data:
    out.data.tokenizer = absolute_tokenizer(out.data.tokenizer)
  return out


def _relative_inputs(config):
  """(setting, value as written, its path) of every relative path the job reads."""
  for section, field in PATH_FIELDS:
    if (section, field) in _OUTPUT_FIELDS or section not in config or field not in config[section]:
      continue
    value = config[section][field]
    if value and value not in _NOT_PATHS.get((section, field), ()):
      yield f"{section}.{field}", str(value), str(value)
  spec = str(config.data.tokenizer) if "data" in config and "tokenizer" in config.data else ""
  kind, sep, path = spec.partition(":")
  if sep and kind in _TOKENIZER_KINDS and path:
    yield "data.tokenizer", spec, path


def check_relative_inputs(config) -> None:
  """Refuses a relative input path that names nothing from the current directory, in one line
  naming the setting, the directory it was resolved against and the path it gave."""
  for name, value, path in _relative_inputs(config):
    path = os.path.expanduser(path)
    if os.path.isabs(path):
      continue
    resolved = os.path.abspath(path)
    found = glob.glob(resolved, recursive=True) if set("*?[") & set(path) else (
        os.path.exists(resolved))
    if not found:
      raise UserError(f"{name}={value!r} is relative, so it is resolved against the directory "
                      f"the command runs in, {os.getcwd()}, to {resolved}, which does not exist; "
                      f"run the command from the directory the paths are relative to, or give "
                      f"an absolute path")


def resolve_job_config(config, command: str):
  """The config a job runs with: every path field absolute, after refusing a relative input
  path that names nothing. (What the student is, and so the model section, is resolved once,
  by the job's recipe: trainers/sources.)"""
  del command  # every command's paths are made absolute alike
  check_relative_inputs(config)
  return resolve_paths(config)
