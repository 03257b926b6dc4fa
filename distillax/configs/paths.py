"""Every path a user writes is relative to the directory the command runs in, made absolute once.

`resolve_job_config` runs where the command line hands its config to a job (main.py), before
anything reads a path: orbax refuses relative checkpoint paths (with a warning lost in the log,
then "no valid checkpoint"), and a relative path kept in a run's config.json would name another
place to a later command started elsewhere. Flags (--workdir, --output, --model) go through
`absolute` there too. PATH_FIELDS is the one list of config fields that hold paths.
"""

from __future__ import annotations

import os

# (section, field) of every config value that is a path (a file, a directory or a glob).
PATH_FIELDS = (("train", "init_from"), ("student", "hf_path"), ("teacher", "workdir"),
               ("teacher", "hf_path"), ("teacher", "cache_dir"), ("data", "source"),
               ("data", "eval_source"), ("data", "chat_template"), ("sequence_kd", "output"),
               ("cache", "dir"))
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


def resolve_job_config(config, command: str):
  """The config a job runs with: every path field absolute. (What the student is, and so the
  model section, is resolved once, by the job's recipe: trainers/sources.)"""
  del command  # every command's paths are made absolute alike
  return resolve_paths(config)
