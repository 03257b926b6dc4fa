"""A data iterator's position as JSON, which the trainer keeps in its checkpoints.

The state is grain's `get_state()` dict (small, JSON-serialisable): where the next row starts
(document index plus offset) and the row-shuffle window position. It is per process: restore it
with the same data config, seed, batch size, seq_len, process count and worker_count. The
trainer saves `iterator_state_json` in every checkpoint (framework/run/checkpoint.py writes one file
per process) and restores it with `restore_iterator_state` on resume and rollback.
"""

from __future__ import annotations

import json

import grain


def iterator_state_json(iterator: grain.DatasetIterator) -> str:
  return json.dumps(iterator.get_state(), sort_keys=True)


def restore_iterator_state(iterator: grain.DatasetIterator, state_json: str) -> None:
  iterator.set_state(json.loads(state_json))
