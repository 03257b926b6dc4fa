"""Rows for cross-tokenizer distillation: each text cut by both tokenizers, aligned by bytes.

A row holds one window of one document twice: the student's tokens (the usual batch keys,
`seq_len` pairs) and the teacher's tokens of the same bytes (TEACHER_* keys, `teacher_seq_len`
pairs, padded to their own length), with the per-position alignment the loss reads
(data.token_alignment.alignment_targets: each position's next-token group on both sides, each
group's kind). Windows end where both tokenizations have a token boundary and neither side's
row is full, so a row's groups are whole; a document longer than a row continues in the next
row (its first token there is predicted by nothing, as in a packed continuation). A group too
long for a row (pathological) is cut at the student's edge, and the teacher tokens across the
cut are left out of both rows.

Rows are not packed: one document (piece) per row, so the two sides' segments stay one each. The
row builder runs per document on the host (grain), in the pipeline's read threads.
"""

from __future__ import annotations

import copy

import grain
import numpy as np

from distillax.data import records
from distillax.data.batch import (BATCH_DTYPES, INPUTS, LOSS_MASK, POSITIONS, SEGMENT_IDS, TARGETS,
                                  padding_rows)
from distillax.data.cross_tokenizer.alignment import SKIP, align_spans, alignment_targets
from distillax.data.cross_tokenizer.token_bytes import encode_with_byte_offsets
from distillax.data.tokenizer import Tokenizer
from distillax.errors import UserError

TEACHER_INPUTS = "teacher_inputs_BxM"
TEACHER_TARGETS = "teacher_targets_BxM"
TEACHER_SEGMENT_IDS = "teacher_segment_ids_BxM"
TEACHER_POSITIONS = "teacher_positions_BxM"
STUDENT_GROUP = "student_group_BxL"   # the group of the token student position i predicts; -1
TEACHER_GROUP = "teacher_group_BxM"   # the same on the teacher's side
GROUP_KIND = "group_kind_BxG"         # SKIP / EXACT / SPAN per group, G = seq_len + 1
TEACHER_KEYS = (TEACHER_INPUTS, TEACHER_TARGETS, TEACHER_SEGMENT_IDS, TEACHER_POSITIONS)


def row_shapes(seq_len: int, teacher_seq_len: int) -> dict[str, tuple[tuple[str, int], ...]]:
  """{key: ((dim name, size), dtype)} of one row: what a step is compiled for."""
  L, M = int(seq_len), int(teacher_seq_len)
  out = {k: (L, v) for k, v in BATCH_DTYPES.items()}
  out.update({TEACHER_INPUTS: (M, np.dtype(np.int32)), TEACHER_TARGETS: (M, np.dtype(np.int32)),
              TEACHER_SEGMENT_IDS: (M, np.dtype(np.int32)),
              TEACHER_POSITIONS: (M, np.dtype(np.int32)),
              STUDENT_GROUP: (L, np.dtype(np.int32)), TEACHER_GROUP: (M, np.dtype(np.int32)),
              GROUP_KIND: (L + 1, np.dtype(np.int32))})
  return out


def padding_batch(num_rows: int, seq_len: int, teacher_seq_len: int, pad_id: int,
                  teacher_pad_id: int) -> dict[str, np.ndarray]:
  """Rows that hold nothing on either side (loss mask 0, no groups)."""
  batch = padding_rows(num_rows, seq_len, pad_id)
  for key, (length, dtype) in row_shapes(seq_len, teacher_seq_len).items():
    if key not in batch:
      batch[key] = np.zeros((num_rows, length), dtype)
  batch[TEACHER_INPUTS][:] = teacher_pad_id
  batch[TEACHER_TARGETS][:] = teacher_pad_id
  batch[STUDENT_GROUP][:] = -1
  batch[TEACHER_GROUP][:] = -1
  batch[GROUP_KIND][:] = SKIP
  return batch


def _encode(tokenizer: Tokenizer, text: str, add_bos: bool):
  """ids [N] and byte spans [N, 2] of BOS + text + EOS (the specials take no bytes)."""
  ids, spans = encode_with_byte_offsets(tokenizer, text)
  ids, spans = np.asarray(ids, np.int32), np.asarray(spans, np.int64).reshape(-1, 2)
  end = len(text.encode("utf-8"))
  if add_bos and tokenizer.bos_id is not None:
    ids, spans = np.concatenate([[tokenizer.bos_id], ids]), np.concatenate([[[0, 0]], spans])
  if tokenizer.eos_id is not None:
    ids, spans = np.concatenate([ids, [tokenizer.eos_id]]), np.concatenate([spans, [[end, end]]])
  return ids.astype(np.int32), spans


def _windows(s_spans, t_spans, s_room: int, t_room: int):
  """(student [i0, i1), teacher [j0, j1)) token ranges of each row, in order."""
  s_end, t_end = s_spans[:, 1], t_spans[:, 1]
  cuts = np.intersect1d(s_end, t_end)
  i0 = j0 = 0
  while i0 < len(s_spans) - 1:
    start, reach = int(s_spans[i0, 0]), int(s_end[min(i0 + s_room, len(s_spans)) - 1])
    near = cuts[np.searchsorted(cuts, start):np.searchsorted(cuts, reach, side="right")]
    s_count = np.searchsorted(s_end, near, side="right") - i0
    t_count = np.searchsorted(t_end, near, side="right") - j0
    fits = (s_count >= 2) & (s_count <= s_room) & (t_count <= t_room)
    if fits.any():
      cut = int(near[np.flatnonzero(fits)[-1]])
      i1, j1 = i0 + int(s_count[fits][-1]), j0 + int(t_count[fits][-1])
    else:  # one group longer than a row: cut at the student's edge
      i1 = min(i0 + s_room, len(s_spans))
      cut = int(s_end[i1 - 1])
      j1 = min(int(np.searchsorted(t_end, cut, side="right")), j0 + t_room)
    yield (i0, i1), (j0, j1)
    i0 = i1
    j0 = max(j1, int(np.searchsorted(t_spans[:, 0], cut, side="left")))


class CrossTokenizeDocument(grain.transforms.Map):
  """text -> the list of its rows (dicts of 1-D arrays, see row_shapes)."""

  def __init__(self, student: Tokenizer, teacher: Tokenizer, teacher_to_student_Vt: np.ndarray,
               seq_len: int, teacher_seq_len: int, add_bos: bool):
    self.student, self.teacher = student, teacher
    self.teacher_to_student_Vt = teacher_to_student_Vt
    self.seq_len, self.teacher_seq_len, self.add_bos = int(seq_len), int(teacher_seq_len), add_bos

  def map(self, document):
    if not isinstance(document, str):
      kind = type(document).__name__
      raise UserError(f"cross-tokenizer distillation takes text documents for now, but the data "
                      f"holds a {kind} record; use text records (--config.data.layout=text)")
    s_ids, s_spans = _encode(self.student, document, self.add_bos)
    t_ids, t_spans = _encode(self.teacher, document, self.add_bos)
    if len(s_ids) < 2 or not document:
      return []
    return [self._row(s_ids[i0:i1], s_spans[i0:i1], t_ids[j0:j1], t_spans[j0:j1])
            for (i0, i1), (j0, j1) in _windows(s_spans, t_spans, self.seq_len + 1,
                                               self.teacher_seq_len + 1)]

  def _row(self, s_ids, s_spans, t_ids, t_spans) -> dict[str, np.ndarray]:
    base = int(s_spans[0, 0]) if len(t_spans) == 0 else int(min(s_spans[0, 0], t_spans[0, 0]))
    alignment = align_spans(s_spans - base, t_spans - base)
    targets = alignment_targets(alignment, s_ids, t_ids, self.teacher_to_student_Vt)
    row = {k: v[0] for k, v in padding_batch(1, self.seq_len, self.teacher_seq_len,
                                             self.student.pad_id, self.teacher.pad_id).items()}
    sides = ((s_ids, (INPUTS, TARGETS, SEGMENT_IDS, POSITIONS, STUDENT_GROUP),
              targets["student_group_N"]),
             (t_ids, (*TEACHER_KEYS, TEACHER_GROUP), targets["teacher_group_M"]))
    for ids, (inputs, outputs, segments, positions, groups), group_N in sides:
      n = max(len(ids) - 1, 0)
      row[inputs][:n], row[outputs][:n] = ids[:-1], ids[1:]
      row[segments][:n], row[positions][:n] = 1, np.arange(n, dtype=np.int32)
      row[groups][:n] = group_N[:n]
    row[LOSS_MASK][:len(s_ids) - 1] = 1.0
    kinds = targets["group_kind_G"]
    row[GROUP_KIND][:len(kinds)] = kinds
    return row


class RowsIterDataset(grain.IterDataset):
  """Flattens the parent's per-document row lists into rows; its state is the parent's before
  the document in progress plus the rows of it already emitted."""

  def __iter__(self):
    return _RowsIterator(self._parent.__iter__())


class _RowsIterator(grain.DatasetIterator):

  def __init__(self, parent):
    super().__init__(parent)
    self._rows, self._offset, self._doc_state = [], 0, None

  def __next__(self):
    while self._offset >= len(self._rows):
      state = self._parent.get_state()
      self._rows, self._offset, self._doc_state = next(self._parent), 0, state
    self._offset += 1
    return self._rows[self._offset - 1]

  def get_state(self):
    if self._offset < len(self._rows):
      return {"documents": copy.deepcopy(self._doc_state), "offset": int(self._offset)}
    return {"documents": copy.deepcopy(self._parent.get_state()), "offset": 0}

  def set_state(self, state):
    self._parent.set_state(copy.deepcopy(state["documents"]))
    self._rows, self._offset, self._doc_state = [], 0, None
    if state["offset"]:
      self._doc_state = copy.deepcopy(state["documents"])
      self._rows, self._offset = next(self._parent), int(state["offset"])


class StackCrossRows:
  """grain batch_fn: stacks rows, padding a short final batch with empty rows."""

  def __init__(self, batch_size: int, seq_len: int, teacher_seq_len: int, pad_id: int,
               teacher_pad_id: int):
    self.args = (int(batch_size), int(seq_len), int(teacher_seq_len), int(pad_id),
                 int(teacher_pad_id))

  def __call__(self, rows) -> dict[str, np.ndarray]:
    batch = padding_batch(*self.args)
    for i, row in enumerate(rows):
      for key, value in row.items():
        batch[key][i] = value
    return batch


def check_text_layout(layout: str) -> None:
  """Chat and prompt/completion records carry a per-token mask of the student's tokenizer and
  a chat template of its own; the teacher's side of them is not built yet."""
  if layout in ("messages", "prompt_completion"):
    raise UserError(f"data.layout={layout!r}: cross-tokenizer distillation takes text documents "
                    f"for now; use --config.data.layout=text")
