"""Every path a job config holds, made absolute once, relative to the directory the job starts in.

orbax refuses relative checkpoint paths (with a warning lost in the log, then "no readable
checkpoint"), and a relative path kept in a run's config.json would name another place to a later
command started elsewhere. The CLI resolves a config before any job sees it
(configs/paths.resolve_job_config); a recipe resolves the config it is given again
(`absolute_paths`), so the Python API gets the same paths: a relative `train.init_from` names
the run the user meant, not an error. PATH_FIELDS is the one list of config fields that hold
paths.
"""

from __future__ import annotations

import os

# (section, field) of every config value that is a path (a file, a directory or a glob).
PATH_FIELDS = (("train", "init_from"), ("student", "hf_path"), ("teacher", "workdir"),
               ("teacher", "hf_path"), ("teacher", "cache_dir"), ("data", "source"),
               ("data", "eval_source"), ("data", "chat_template"), ("sequence_kd", "output"),
               ("cache", "dir"))
# Values of those fields that name something other than a path.
NOT_PATHS = {("data", "source"): ("stdlib",)}
# 'kind:<path>' tokenizer specs ('byte' has no path).
TOKENIZER_KINDS = ("hf", "spm")


def absolute(path: str | None) -> str | None:
  """`path` from the current directory (with ~ expanded); '' and None stay as they are."""
  if not path:
    return path
  return os.path.abspath(os.path.expanduser(str(path)))


def absolute_tokenizer(spec: str) -> str:
  """'hf:<path>' / 'spm:<path>' with an absolute path; 'byte' and malformed specs unchanged
  (the tokenizer's own check words those)."""
  kind, sep, path = str(spec).partition(":")
  if sep and kind in TOKENIZER_KINDS and path:
    return f"{kind}:{absolute(path)}"
  return spec


def _changes(config) -> dict[tuple[str, str], str]:
  """{(section, field): absolute value} of every path field whose value is not absolute yet."""
  out = {}
  for section, field in PATH_FIELDS:
    if section in config and field in config[section]:
      value = config[section][field]
      if value and value not in NOT_PATHS.get((section, field), ()):
        out[(section, field)] = absolute(value)
  for section in ("data", "teacher"):  # teacher.tokenizer: a cross-tokenizer teacher's
    if section in config and config[section].get("tokenizer"):
      out[(section, "tokenizer")] = absolute_tokenizer(config[section].tokenizer)
  return {k: v for k, v in out.items() if v != config[k[0]][k[1]]}


def resolve_paths(config):
  """A copy of `config` whose path fields (those present) are absolute."""
  out = config.copy_and_resolve_references()
  for (section, field), value in _changes(out).items():
    out[section][field] = value
  return out


def absolute_paths(config):
  """`config` itself when every path in it is absolute already (a config the CLI resolved),
  else `resolve_paths(config)`."""
  return resolve_paths(config) if _changes(config) else config
