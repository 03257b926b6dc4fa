"""What a model source is on disk: a distillax run's config.json, a Hugging Face checkpoint's
config.json, and the fingerprint of the files behind a source (what resume compares).

Each reader names the setting that pointed at the directory, so a wrong directory is one line
naming it and the fix.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os

import ml_collections

from distillax.errors import UserError
from distillax.models.config import TransformerConfig
from distillax.models.hf.config import config_from_hf

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
# Keys of a Hugging Face config.json that a distillax run's config.json never has.
_HF_KEYS = ("model_type", "architectures", "transformers_version")
# Bytes of each weight file hashed into a fingerprint: a safetensors header (its tensor names,
# dtypes, shapes and offsets) fits many times over; the size catches a changed payload length.
_HEAD_BYTES = 1 << 16


def where(path: str, field: str) -> str:
  """`field=path` as the user wrote it (or `--model path` for a flag)."""
  if not field:
    return path
  return f"{field} {path}" if field.startswith("--") else f"{field}={path}"


@functools.lru_cache(maxsize=32)
def _read_json(file: str, mtime: float) -> object:
  with open(file) as f:
    return json.load(f)


def read_json(file: str) -> object:
  """A JSON file, read once per process while it is unchanged (a source's config.json is read
  by every job that asks about the source)."""
  return copy.deepcopy(_read_json(os.path.realpath(file), os.path.getmtime(file)))


def load_run_config(workdir: str, field: str = "") -> ml_collections.ConfigDict:
  """The config.json of the distillax run in `workdir`."""
  at = where(workdir, field)
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise UserError(f"{at} is not a distillax run directory (no {CONFIG_FILE}); point to "
                    f"the --workdir of a finished run")
  try:
    raw = read_json(path)
  except (OSError, ValueError) as e:
    raise UserError(f"{at}: {CONFIG_FILE} is unreadable ({e}); point to the --workdir of a "
                    f"finished distillax run") from None
  if isinstance(raw, dict) and "trainer" in raw and "model" in raw:
    return ml_collections.ConfigDict(raw)
  if isinstance(raw, dict) and any(k in raw for k in _HF_KEYS):
    raise UserError(f"{at} is a Hugging Face checkpoint, not a distillax run; "
                    f"{field or 'it'} must be a distillax run's directory (the --workdir it "
                    f"trained in); a Hugging Face teacher goes in --config.teacher.hf_path, a "
                    f"Hugging Face student in --config.student.hf_path or train.init_from")
  raise UserError(f"{at}: {CONFIG_FILE} was not written by distillax (no trainer and model "
                  f"sections); point to the --workdir of a finished distillax run")


def is_hf_checkpoint(path: str) -> bool:
  """Whether `path` is a Hugging Face checkpoint directory (its config.json has HF keys)."""
  try:
    raw = read_json(os.path.join(path, CONFIG_FILE))
  except (OSError, ValueError):
    return False
  return isinstance(raw, dict) and any(k in raw for k in _HF_KEYS)


def hf_checkpoint_config(path: str, field: str) -> TransformerConfig:
  """The model config of the Hugging Face checkpoint `field` names, or one line saying what
  the directory is instead."""
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(file):
    raise UserError(f"{field}={path} has no config.json; point it at a Hugging Face checkpoint "
                    f"directory (config.json + *.safetensors)")
  if not is_hf_checkpoint(path):
    raise UserError(f"{field}={path} is not a Hugging Face checkpoint (its config.json has no "
                    f"model_type); a distillax run's directory goes in train.init_from or "
                    f"teacher.workdir")
  return config_from_hf(read_json(file), where=file)


def hf_tokenizer_file(spec: str) -> str | None:
  """The tokenizer.json of an 'hf:<file or folder>' tokenizer spec; None for other specs."""
  kind, _, path = str(spec).strip().partition(":")
  if kind != "hf" or not path:
    return None
  path = os.path.expanduser(path)
  return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


def files_fingerprint(directory: str, names: list[str]) -> list[list]:
  """[name, size, sha256 of the first 64 KiB] of each file: a rewritten or swapped weight file
  changes it; reading it costs a header per file whatever the model's size."""
  out = []
  for name in sorted(names):
    path = os.path.join(directory, name)
    with open(path, "rb") as f:
      head = hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest()
    out.append([name, os.path.getsize(path), head])
  return out
