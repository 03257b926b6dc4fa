"""Record files in the layouts Hugging Face data sets use: JSONL and Parquet, read lazily.

A record (a JSONL line, a Parquet row, a JSON ArrayRecord) becomes one document in one of three
layouts, the ones `datasets`/TRL use:

  text               {"text": "..."}                       -> a str (`data.text_field` names it)
  messages           {"messages": [{"role", "content"}, ...]} -> a ChatRecord: the whole chat is
                     rendered with the tokenizer's chat template, assistant turns are trained
  prompt_completion  {"prompt": ..., "completion": ...}    -> a PromptCompletion (two strings:
                     the completion is trained) or, when the prompt is a list of messages, a
                     ChatRecord whose completion messages are trained

`data.layout='auto'` picks the layout per record from the fields it has (messages, then
prompt/completion, then the text field); naming a layout makes every record need its fields.

A chat message's role is one of ROLES (the assistant's turns are trained); any other role
(`bot`, `human`) is an error naming the record, not a turn silently left untrained. Errors name a
JSONL record by its line number (what an editor shows), a Parquet record by its row.

Laziness: nothing holds the records. A JSONL file is indexed once (the byte span and line
number of every non-empty line: 20 bytes a record) and a record is read by seeking to its line. A
Parquet file is indexed by its footer (rows per row group) and a record is read by decoding its
row group (only the columns the layout needs), of which a small LRU of `ROW_GROUP_CACHE` decoded
groups is kept.
Under a global shuffle most reads decode a new group, so Parquet files for training want small
row groups (100-1000 rows, what `datasets` writes) or a conversion to JSONL.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading

import numpy as np

from distillax.errors import ConfigError, UserError

LAYOUTS = ("auto", "text", "messages", "prompt_completion")
PROMPT, COMPLETION = "prompt", "completion"
# The roles a chat message may have: what chat templates and TRL know (tool: a tool's output;
# developer: OpenAI's system; ipython: Llama 3.1's tool output). Only 'assistant' is trained.
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
# Roles other data sets use for the same turns, to name the fix.
_ROLE_ALIASES = {"bot": "assistant", "model": "assistant", "gpt": "assistant",
                 "ai": "assistant", "chatbot": "assistant", "human": "user"}
ROW_GROUP_CACHE = 2  # decoded Parquet row groups kept per file (one per default read thread)


@dataclasses.dataclass(frozen=True)
class ChatRecord:
  """A conversation. prompt_messages None: train on the assistant turns; an int n: the first n
  messages are the prompt and everything the template writes after them is trained."""

  messages: tuple
  prompt_messages: int | None = None
  source: str = dataclasses.field(default="", compare=False)  # names the record in errors


@dataclasses.dataclass(frozen=True)
class PromptCompletion:
  """A plain-text prompt and its completion: the text is prompt + completion."""

  prompt: str
  completion: str
  source: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass(frozen=True)
class RecordLayout:
  """Which fields of a record hold its document (see the module doc)."""

  layout: str = "auto"
  text_field: str = "text"
  messages_field: str = "messages"

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ConfigError(f"data.layout={self.layout!r} is not one of {', '.join(LAYOUTS)}")

  @classmethod
  def from_config(cls, cfg) -> "RecordLayout":
    return cls(str(cfg.layout), str(cfg.text_field), str(cfg.messages_field))

  def columns(self) -> tuple[str, ...]:
    """The fields a record of this layout may be read from (Parquet reads only these)."""
    return {"text": (self.text_field,), "messages": (self.messages_field,),
            "prompt_completion": (PROMPT, COMPLETION)}.get(
                self.layout, (self.messages_field, PROMPT, COMPLETION, self.text_field))

  def extract(self, record, where: str):
    """A record (dict) -> str | PromptCompletion | ChatRecord; `where` names it in errors."""
    if not isinstance(record, dict):
      raise UserError(f"{where} is not a JSON object; every record needs one")
    layout = self.layout if self.layout != "auto" else _detect(record, self)
    if layout == "messages":
      return ChatRecord(_messages(record.get(self.messages_field), where, self.messages_field),
                        source=where)
    if layout == "prompt_completion":
      return _prompt_completion(record, where)
    if layout == "text" and isinstance(record.get(self.text_field), str):
      return record[self.text_field]
    fields = ", ".join(sorted(map(str, record))) or "none"
    if self.layout == "text":
      raise UserError(f"{where} has no string field {self.text_field!r} (fields: {fields}); "
                      f"every record needs one (or set data.text_field)")
    raise UserError(
        f"{where} has no string field {self.text_field!r}, no {self.messages_field!r} list and "
        f"no {PROMPT!r}/{COMPLETION!r} pair (fields: {fields}); fix the record or set "
        f"data.text_field / data.messages_field / data.layout")


def _detect(record: dict, layout: RecordLayout) -> str:
  if isinstance(record.get(layout.messages_field), list):
    return "messages"
  if PROMPT in record and COMPLETION in record:
    return "prompt_completion"
  return "text"


def _messages(value, where: str, field: str) -> tuple:
  if not isinstance(value, (list, tuple)) or not value:
    raise UserError(f"{where}: {field!r} must be a non-empty list of {{role, content}} messages")
  for i, message in enumerate(value):
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
      raise UserError(f"{where}: message {i} of {field!r} is not an object with a string "
                      f"'role'; write messages as {{\"role\": ..., \"content\": ...}}")
    role = message["role"]
    if role not in ROLES:
      alias = _ROLE_ALIASES.get(role.strip().lower())
      fix = f"rename it to {alias!r}" if alias else "rename it to one of these"
      raise UserError(f"{where}: message {i} of {field!r} has role {role!r}; a chat's roles are "
                      f"{', '.join(ROLES)} (the assistant's turns are trained): {fix}")
  return tuple(value)


def _prompt_completion(record: dict, where: str):
  """TRL's two forms: both strings, or a list of prompt messages and a completion that is a
  list of (assistant) messages or a string (taken as one assistant message)."""
  prompt, completion = record.get(PROMPT), record.get(COMPLETION)
  if isinstance(prompt, str) and isinstance(completion, str):
    return PromptCompletion(prompt, completion, source=where)
  if isinstance(prompt, (list, tuple)):
    if isinstance(completion, str):
      completion = [{"role": "assistant", "content": completion}]
    prompt_messages = _messages(prompt, where, PROMPT)
    messages = prompt_messages + _messages(completion, where, COMPLETION)
    return ChatRecord(messages, prompt_messages=len(prompt_messages), source=where)
  raise UserError(f"{where}: {PROMPT!r} and {COMPLETION!r} must be two strings, or a list of "
                  f"messages and a completion (messages or a string)")


class JsonlRecords:
  """Each non-empty line of a JSONL file is one record, read on access through a line index."""

  def __init__(self, root: str, path: str, layout: RecordLayout):
    self.path = path
    self.layout = layout
    self.starts, self.ends, self.lines = line_spans(path)
    self._rel = rel_key(root, path)

  def key(self, i: int) -> str:
    return f"{self._rel}:{i}"

  def __len__(self):
    return len(self.starts)

  def __getitem__(self, i: int):
    with open(self.path, "rb") as f:
      f.seek(int(self.starts[i]))
      return self.parse(i, f.read(int(self.ends[i] - self.starts[i])))

  def records(self):
    """Every record in file order, read in one pass (what a check of the whole file wants)."""
    with open(self.path, "rb") as f:
      for i in range(len(self)):
        f.seek(int(self.starts[i]))
        yield self.parse(i, f.read(int(self.ends[i] - self.starts[i])))

  def parse(self, i: int, line: bytes):
    """Record i from the bytes of its line."""
    where = f"{self.path}: line {int(self.lines[i])}"
    if not line.strip():
      return ""  # a whitespace-only line: an empty document, which the pipeline skips
    try:
      text = line.decode("utf-8")
    except UnicodeDecodeError as e:
      raise UserError(f"{where} is not UTF-8 text (byte {e.start + 1} of the line is "
                      f"{line[e.start:e.start + 1]!r}); JSONL is UTF-8: re-encode the file "
                      f"(e.g. iconv -f latin1 -t utf-8) or drop that line") from None
    try:
      record = json.loads(text)
    except json.JSONDecodeError as e:
      raise UserError(f"{where} is not valid JSON ({e}); fix or drop that line") from None
    return self.layout.extract(record, where)


class ParquetRecords:
  """Each row of a Parquet file is one record, read on access by decoding its row group."""

  def __init__(self, root: str, path: str, layout: RecordLayout):
    self.path = path
    self.layout = layout
    self._rel = rel_key(root, path)
    metadata, names = _parquet_footer(path)
    self.columns = tuple(c for c in layout.columns() if c in names)
    if not self.columns:
      raise UserError(f"{path}: no column for data.layout={layout.layout!r} (wanted "
                      f"{', '.join(layout.columns())}; the file has {', '.join(names)}); set "
                      f"data.text_field / data.messages_field / data.layout")
    rows = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
    self.group_starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    self._reset_cache()

  def _reset_cache(self):
    self._cache = collections.OrderedDict()
    self._lock = threading.Lock()

  def key(self, i: int) -> str:
    return f"{self._rel}:{i}"

  def __len__(self):
    return int(self.group_starts[-1])

  def __getitem__(self, i: int):
    group = int(np.searchsorted(self.group_starts, i, side="right")) - 1
    table = self._row_group(group)
    row = int(i) - int(self.group_starts[group])
    record = {c: table.column(c)[row].as_py() for c in self.columns}
    return self.layout.extract(record, f"{self.path}: row {i}")

  def records(self):
    """Every record in file order, one row group decoded at a time (none kept)."""
    import pyarrow.parquet as pq
    parquet_file = pq.ParquetFile(self.path)
    for group in range(len(self.group_starts) - 1):
      columns = parquet_file.read_row_group(group, columns=list(self.columns)).to_pydict()
      start = int(self.group_starts[group])
      for row in range(int(self.group_starts[group + 1]) - start):
        record = {c: columns[c][row] for c in self.columns}
        yield self.layout.extract(record, f"{self.path}: row {start + row}")

  def _row_group(self, group: int):
    with self._lock:
      if group in self._cache:
        self._cache.move_to_end(group)
        return self._cache[group]
    import pyarrow.parquet as pq
    table = pq.ParquetFile(self.path).read_row_group(group, columns=list(self.columns))
    with self._lock:
      self._cache[group] = table
      while len(self._cache) > ROW_GROUP_CACHE:
        self._cache.popitem(last=False)
    return table

  def __getstate__(self):  # grain workers get a copy: no decoded groups, no lock
    state = dict(self.__dict__)
    del state["_cache"], state["_lock"]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._reset_cache()


def _parquet_footer(path: str):
  try:
    import pyarrow.parquet as pq
  except ImportError as e:
    raise ConfigError("Parquet data needs pyarrow; install it with pip install pyarrow") from e
  try:
    parquet_file = pq.ParquetFile(path)
  except Exception as e:  # pyarrow raises ArrowInvalid/OSError with its own messages
    raise UserError(f"{path}: not a readable Parquet file ({e}); check data.format") from e
  return parquet_file.metadata, parquet_file.schema_arrow.names


def rel_key(root: str, path: str) -> str:
  return os.path.relpath(path, root).replace(os.sep, "/")


def line_spans(path: str, chunk_bytes: int = 1 << 24
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Byte [start, end) and 1-based line number of every non-empty line, found in chunks so
  big files stay cheap."""
  newlines = []
  size = 0
  with open(path, "rb") as f:
    while True:
      chunk = f.read(chunk_bytes)
      if not chunk:
        break
      newlines.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + size)
      size += len(chunk)
  ends = np.concatenate(newlines + [np.array([size])]).astype(np.int64)
  starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
  keep = ends > starts
  return starts[keep], ends[keep], (np.flatnonzero(keep) + 1).astype(np.int32)
