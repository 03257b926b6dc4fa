"""Saving and restoring a data iterator's position: JSON on its own, or inside an orbax checkpoint.

The state is grain's `get_state()` dict (small, JSON-serialisable): where the next row starts
(document index plus offset) and the row-shuffle window position. It is per process: restore it
with the same data config, seed, batch size, seq_len, process count and worker_count.
"""

from __future__ import annotations

import json
import os

import grain


def iterator_state_json(iterator: grain.DatasetIterator) -> str:
  return json.dumps(iterator.get_state(), sort_keys=True)


def restore_iterator_state(iterator: grain.DatasetIterator, state_json: str) -> None:
  iterator.set_state(json.loads(state_json))


def save_iterator_state(iterator: grain.DatasetIterator, path: str) -> None:
  """Writes the state as JSON, atomically (a temp file renamed into place)."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    f.write(iterator_state_json(iterator))
  os.replace(tmp, path)


def load_iterator_state(iterator: grain.DatasetIterator, path: str) -> None:
  with open(path) as f:
    restore_iterator_state(iterator, f.read())


def orbax_save_args(iterator: grain.DatasetIterator):
  """The item for `ocp.args.Composite(..., data=orbax_save_args(it))` in a CheckpointManager save.

  grain's handler writes `process_<i>-of-<n>.json` per JAX process under the item's folder.
  """
  return grain.checkpoint.CheckpointSave(iterator)


def orbax_restore_args(iterator: grain.DatasetIterator):
  """The restore twin: orbax sets the state of `iterator` (a fresh one, built the same way)."""
  return grain.checkpoint.CheckpointRestore(iterator)
