"""Packing: a stream of tokenized documents -> fixed-length rows of next-token pairs.

A document of n tokens holds n-1 (input, target) pairs. Pairs are laid into rows of `seq_len`
slots in stream order ("concatenate, then split"): a document that does not fit in the rest of a
row continues at the start of the next row. Each piece of a document inside a row is one
segment (ids 1, 2, ... within the row; 0 = padding) whose positions restart at 0, so attention
restricted to equal segment ids never crosses a document, and every target is the document's own
next token: a piece ending at the row's edge keeps its last target (the first input of the
continuation), so every in-document pair is trained on exactly once and no pair spans two
documents. Only the last row of a finite stream has padding.

Loss mask: 1 on every pair of a text document. A document may come with a per-token train mask
(chat and prompt/completion records: 1 on assistant / completion tokens); then a pair's loss mask
is the mask of its target token, so a packed row keeps exactly the record's trained targets, and
padding stays 0.

The iterator's state is where the next row starts: the parent's state before the document in
progress plus how many of its pairs were already emitted. Restoring re-reads that one document.
"""

from __future__ import annotations

import copy

import grain
import numpy as np

from distillax.data.batch import (BATCH_KEYS, INPUTS, LOSS_MASK, POSITIONS, SEGMENT_IDS, TARGETS,
                                  padding_rows)


class PackedIterDataset(grain.IterDataset):
  """Packs the parent's documents into rows (see module doc): int32 token arrays, or (tokens,
  float32 per-token train mask) pairs.

  Rows use the batch keys with a length-L leading shape; `StackRows` batches them.
  """

  def __init__(self, parent: grain.IterDataset, *, seq_len: int, pad_id: int):
    super().__init__(parent)
    self._seq_len = int(seq_len)
    self._pad_id = int(pad_id)

  def __iter__(self) -> grain.DatasetIterator:
    return _PackedIterator(self._parent.__iter__(), seq_len=self._seq_len, pad_id=self._pad_id)

  def __str__(self) -> str:
    return f"PackedIterDataset(seq_len={self._seq_len})"


class _PackedIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, *, seq_len: int, pad_id: int):
    super().__init__(parent)
    self._seq_len = seq_len
    self._pad_id = pad_id
    self._doc = None            # tokens of the document in progress
    self._doc_mask = None       # its per-token train mask (None: every token)
    self._doc_parent_state = None  # the parent's state just before that document
    self._offset = 0            # its pairs already emitted

  def _doc_pairs_left(self) -> int:
    return 0 if self._doc is None else len(self._doc) - 1 - self._offset

  def _fetch_document(self) -> bool:
    state = self._parent.get_state()
    try:
      tokens = next(self._parent)
    except StopIteration:
      self._doc = None
      return False
    if isinstance(tokens, tuple):
      tokens, self._doc_mask = tokens
    else:
      self._doc_mask = None
    self._doc, self._doc_parent_state, self._offset = tokens, state, 0
    return True

  def __next__(self) -> dict[str, np.ndarray]:
    length = self._seq_len
    row = {k: v[0] for k, v in padding_rows(1, length, self._pad_id).items()}
    filled = segment = 0
    while filled < length:
      if self._doc_pairs_left() <= 0:
        if not self._fetch_document():
          break
        continue
      take = min(length - filled, self._doc_pairs_left())
      start, stop = self._offset, self._offset + take
      segment += 1
      row[INPUTS][filled:filled + take] = self._doc[start:stop]
      row[TARGETS][filled:filled + take] = self._doc[start + 1:stop + 1]
      row[SEGMENT_IDS][filled:filled + take] = segment
      row[POSITIONS][filled:filled + take] = np.arange(take, dtype=np.int32)
      row[LOSS_MASK][filled:filled + take] = (
          1.0 if self._doc_mask is None else self._doc_mask[start + 1:stop + 1])
      filled += take
      self._offset = stop
    if filled == 0:
      raise StopIteration
    return row

  def get_state(self) -> dict:
    if self._doc_pairs_left() > 0:
      return {"documents": copy.deepcopy(self._doc_parent_state), "offset": int(self._offset)}
    return {"documents": copy.deepcopy(self._parent.get_state()), "offset": 0}

  def set_state(self, state: dict) -> None:
    self._parent.set_state(copy.deepcopy(state["documents"]))
    self._doc, self._doc_parent_state, self._offset = None, None, 0
    if state["offset"]:
      if not self._fetch_document():
        raise ValueError("packing state points past the end of the documents; the data source "
                         "changed since the state was saved")
      self._offset = int(state["offset"])

  def __str__(self) -> str:
    return "PackedIterator"


class StackRows:
  """grain batch_fn: stacks rows into [B, L] arrays, padding a short final batch to B rows."""

  def __init__(self, batch_size: int, seq_len: int, pad_id: int):
    self.batch_size, self.seq_len, self.pad_id = int(batch_size), int(seq_len), int(pad_id)

  def __call__(self, rows) -> dict[str, np.ndarray]:
    batch = padding_rows(self.batch_size, self.seq_len, self.pad_id)
    for i, row in enumerate(rows):
      for key in BATCH_KEYS:
        batch[key][i] = row[key]
    return batch
