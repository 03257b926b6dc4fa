"""Where documents come from: text, JSONL, Parquet and ArrayRecord files, and the stdlib corpus.

A `Documents` object is a random-access list of documents (what `grain.MapDataset.source`
wants), read lazily: building one only lists files and indexes them (JSONL line offsets, Parquet
row groups). Every document has a stable key (a path relative to the source's root, plus
':<record>' inside JSONL, Parquet and ArrayRecord files); the train/validation split hashes that
key, so it does not depend on the machine, the file listing order or Python's per-process hash
seed.

Document boundaries: a plain text file is one document; a JSONL line, a Parquet row and an
ArrayRecord record are one document each. A record is a text (its `text` field), a chat or a
prompt/completion pair, by its layout (records.py); an ArrayRecord record may also be UTF-8 text.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import sysconfig

import numpy as np

from distillax.data.records import JsonlRecords, ParquetRecords, RecordLayout, rel_key
from distillax.errors import ConfigError, UserError

FORMATS = ("auto", "text", "jsonl", "parquet", "arrayrecord")
_GLOB_CHARS = frozenset("*?[")
# Folders of the standard library left out of the default corpus: installed packages, the
# (large, repetitive) test suites and byte-code caches.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                               "idle_test"})


def resolve_files(spec: str) -> tuple[str, list[str]]:
  """A path, directory or glob -> (root used for relative keys, sorted list of files)."""
  spec = os.path.expanduser(str(spec))
  parts = spec.split(os.sep)
  if any(_GLOB_CHARS & set(p) for p in parts):
    first_glob = next(i for i, p in enumerate(parts) if _GLOB_CHARS & set(p))
    root = os.sep.join(parts[:first_glob]) or "."
    files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
    if not files:
      raise UserError(f"data source {spec!r}: the glob matched no files; check the pattern")
    return root, files
  if os.path.isdir(spec):
    files = sorted(
        os.path.join(d, f) for d, subdirs, names in os.walk(spec) for f in names
        if not f.startswith("."))
    if not files:
      raise UserError(f"data source {spec!r}: the directory holds no files")
    return spec, files
  if os.path.isfile(spec):
    return os.path.dirname(spec) or ".", [spec]
  raise UserError(f"data source {spec!r}: no such file or directory; check the path")


def infer_format(path: str) -> str:
  name = os.path.basename(path).lower()
  if name.endswith((".jsonl", ".json", ".ndjson")):
    return "jsonl"
  if name.endswith((".parquet", ".pq")):
    return "parquet"
  if "array_record" in name or name.endswith(".arrayrecord"):
    return "arrayrecord"
  return "text"


class TextFiles:
  """Each file is one document."""

  def __init__(self, root: str, files: list[str]):
    self.files = list(files)
    self._keys = [rel_key(root, f) for f in self.files]

  def key(self, i: int) -> str:
    return self._keys[i]

  def __len__(self):
    return len(self.files)

  def __getitem__(self, i: int) -> str:
    with open(self.files[i], "rb") as f:
      return f.read().decode("utf-8", errors="replace")


class ArrayRecordFile:
  """Each record is one document: a JSON object read by its layout, else UTF-8 text."""

  def __init__(self, root: str, path: str, layout: RecordLayout):
    import grain
    self.path = path
    self.layout = layout
    try:
      self._records = grain.sources.ArrayRecordDataSource([path])
      count = len(self._records)
    except Exception as e:  # array_record raises RuntimeError/ValueError with C++ messages
      raise UserError(f"{path}: not a readable ArrayRecord file ({e}); check data.format") from e
    self._rel, self._count = rel_key(root, path), count

  def key(self, i: int) -> str:
    return f"{self._rel}:{i}"

  def __len__(self):
    return self._count

  def __getitem__(self, i: int):
    raw = self._records[i]
    if raw[:1] == b"{":
      try:
        record = json.loads(raw)
      except (json.JSONDecodeError, UnicodeDecodeError):  # not JSON: read as text
        record = None
      if isinstance(record, dict):
        try:
          return self.layout.extract(record, f"{self.path}: record {i}")
        except UserError:
          if self.layout.layout != "auto":
            raise
    return raw.decode("utf-8", errors="replace")


class Documents:
  """A selection of documents from one or more files, in a fixed order."""

  def __init__(self, parts, indices=None, name: str = ""):
    self.parts = list(parts)
    sizes = [len(p) for p in self.parts]
    self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total = int(self._offsets[-1])
    self.indices = (np.arange(total, dtype=np.int64) if indices is None
                    else np.asarray(indices, dtype=np.int64))
    self.name = name

  def __len__(self):
    return len(self.indices)

  def _locate(self, i: int) -> tuple[int, int]:
    g = int(self.indices[i])
    part = int(np.searchsorted(self._offsets, g, side="right")) - 1
    return part, g - int(self._offsets[part])

  def __getitem__(self, i: int):
    """A str, or a records.ChatRecord / PromptCompletion for chat and prompt/completion rows."""
    part, j = self._locate(i)
    return self.parts[part][j]

  def key(self, i: int) -> str:
    part, j = self._locate(i)
    return self.parts[part].key(j)

  def all_keys(self) -> list[str]:
    parts = np.searchsorted(self._offsets, self.indices, side="right") - 1
    local = self.indices - self._offsets[parts]
    return [self.parts[p].key(j) for p, j in zip(parts.tolist(), local.tolist())]

  def split(self, validation_fraction: float) -> tuple["Documents", "Documents"]:
    """(train, validation) by a hash of each document's key."""
    held_out = validation_mask(self.all_keys(), validation_fraction)
    return (Documents(self.parts, self.indices[~held_out], f"{self.name} (train split)"),
            Documents(self.parts, self.indices[held_out], f"{self.name} (validation split)"))


def validation_mask(keys, fraction: float) -> np.ndarray:
  """True for keys whose SHA-256 falls in the first `fraction` of the hash space."""
  if not 0.0 <= float(fraction) < 1.0:
    raise ConfigError(f"data.validation_fraction={fraction} must be in [0, 1); e.g. 0.05")
  threshold = int(float(fraction) * 2**64)
  return np.array(
      [int.from_bytes(hashlib.sha256(k.encode("utf-8")).digest()[:8], "big") < threshold
       for k in keys], dtype=bool)


def load_documents(spec: str, fmt: str = "auto", text_field: str = "text",
                   layout: RecordLayout | None = None) -> Documents:
  """A path/dir/glob (or 'stdlib') and a format name -> all its documents. `layout` says how a
  record holds its document (default: detected per record, the text in `text_field`)."""
  layout = layout if layout is not None else RecordLayout("auto", text_field)
  if str(spec) == "stdlib":
    root, files = stdlib_files()
    return Documents([TextFiles(root, files)], name="stdlib")
  if fmt not in FORMATS:
    raise ConfigError(f"data.format={fmt!r} is not one of {', '.join(FORMATS)}")
  root, files = resolve_files(spec)
  text_files, parts = [], []
  for path in files:
    file_fmt = infer_format(path) if fmt == "auto" else fmt
    if file_fmt == "text":
      text_files.append(path)
    elif file_fmt == "jsonl":
      parts.append(JsonlRecords(root, path, layout))
    elif file_fmt == "parquet":
      parts.append(ParquetRecords(root, path, layout))
    else:
      parts.append(ArrayRecordFile(root, path, layout))
  if text_files:
    parts.insert(0, TextFiles(root, text_files))
  docs = Documents(parts, name=str(spec))
  if len(docs) == 0:
    raise UserError(f"data source {spec!r} holds no documents (empty files?)")
  return docs


@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[str, list[str]]:
  """(stdlib root, sorted *.py files) of the running interpreter, without tests and packages."""
  root = sysconfig.get_paths()["stdlib"]
  files = []
  for d, subdirs, names in os.walk(root):
    subdirs[:] = sorted(s for s in subdirs if s not in _STDLIB_SKIP_DIRS and not s.startswith("."))
    files.extend(os.path.join(d, n) for n in names if n.endswith(".py"))
  files.sort(key=lambda f: rel_key(root, f))
  if not files:
    raise UserError(f"no Python source files found in the standard library at {root!r}; "
                    "set data.source to a path or glob of text files")
  return root, files
