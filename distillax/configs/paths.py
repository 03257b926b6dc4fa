"""Every path a user writes is relative to the directory the command runs in, made absolute once.

`resolve_job_config` runs where the command line hands its config to a job (main.py), before
anything reads a path: orbax refuses relative checkpoint paths (with a warning lost in the log,
then "no valid checkpoint"), and a relative path kept in a run's config.json would name another
place to a later command started elsewhere. Flags (--workdir, --output, --model) go through
`absolute` there too. PATH_FIELDS (trainers/paths.py) is the one list of config fields that
hold paths.

A relative path that names nothing there is refused in one line saying what it was resolved
against: the usual cause is a command run from another directory than the one its paths are
relative to, which otherwise surfaced as a traceback wherever the path was first read.
"""

from __future__ import annotations

import glob
import os

from distillax.errors import UserError
# The paths themselves are made absolute where every job's recipe does it too (trainers/paths.py).
from distillax.trainers.paths import (NOT_PATHS, PATH_FIELDS, TOKENIZER_KINDS, absolute,
                                      absolute_tokenizer, resolve_paths)

# Those the job writes (they need not exist yet).
_OUTPUT_FIELDS = (("sequence_kd", "output"), ("cache", "dir"))


def _relative_inputs(config):
  """(setting, value as written, its path) of every relative path the job reads."""
  for section, field in PATH_FIELDS:
    if (section, field) in _OUTPUT_FIELDS or section not in config or field not in config[section]:
      continue
    value = config[section][field]
    if value and value not in NOT_PATHS.get((section, field), ()):
      yield f"{section}.{field}", str(value), str(value)
  for section in ("data", "teacher"):
    spec = str(config[section].get("tokenizer") or "") if section in config else ""
    kind, sep, path = spec.partition(":")
    if sep and kind in TOKENIZER_KINDS and path:
      yield f"{section}.tokenizer", spec, path


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


__all__ = ["PATH_FIELDS", "absolute", "absolute_tokenizer", "check_relative_inputs",
           "resolve_job_config", "resolve_paths"]
