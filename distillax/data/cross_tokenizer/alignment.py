"""Aligning two tokenizations of one text by their byte offsets (cross-tokenizer distillation).

A group is a run of student tokens and a run of teacher tokens that cover exactly the same
bytes: one-to-one where both tokenizers cut the text alike, many-to-one, one-to-many or
many-to-many where they differ ("naïve" as "na" "ï" "ve" against "nai" "̈" "ve" ...). Groups end
at the byte positions where neither side has a token running across, so each group is the
smallest piece of text both sides can score.

Tokens with no bytes (BOS/EOS the pipeline adds, a special token the text does not spell) cannot
be placed by bytes. Those that sit at the same byte position on both sides, as many on each
side, pair off in order as one-to-one groups (EOS after the text on both sides); all others
align to nothing and are reported as NO_BYTES. A token whose bytes the other side does not cover
(a tokenizer that drops spaces) is UNMATCHED.

`alignment_targets` turns an alignment into what the loss reads per predicting position (a
causal LM's position i predicts token i + 1): the group of the token each position predicts, and
whether that group is compared exactly (one-to-one, the two tokens the same byte string in both
vocabularies) or by span probability. A group is scored only when every token of it is
predicted on both sides (a document's first token is not) and trained (the student's loss mask).

Everything is vectorised numpy: it runs in the grain pipeline, per record.
"""

from __future__ import annotations

import dataclasses

import numpy as np

UNMATCHED = -1  # the token's bytes are not covered alike by the other side
NO_BYTES = -2   # the token has no bytes and no partner at its position (BOS/EOS on one side)
# Group kinds, per group (alignment_targets).
SKIP, EXACT, SPAN = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Alignment:
  """Per-token group ids (0 .. num_groups - 1, in text order) or UNMATCHED / NO_BYTES."""
  student_group_N: np.ndarray  # int32
  teacher_group_M: np.ndarray  # int32
  num_groups: int

  def groups(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(student token indices, teacher token indices) of each group, in order."""
    out = [([], []) for _ in range(self.num_groups)]
    for side, group_ids in enumerate((self.student_group_N, self.teacher_group_M)):
      for index, group in enumerate(group_ids.tolist()):
        if group >= 0:
          out[group][side].append(index)
    return [(tuple(s), tuple(t)) for s, t in out]

  def left_out(self, kind: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(student, teacher) indices of the tokens marked `kind` (UNMATCHED or NO_BYTES)."""
    return (tuple(np.flatnonzero(self.student_group_N == kind).tolist()),
            tuple(np.flatnonzero(self.teacher_group_M == kind).tolist()))


def _straddles(spans_Nx2: np.ndarray, num_positions: int) -> np.ndarray:
  """How many tokens run across each byte position p (start < p < end), p in [0, num_positions)."""
  start_N, end_N = spans_Nx2[:, 0], spans_Nx2[:, 1]
  wide_N = end_N - start_N >= 2
  steps = (np.bincount(start_N[wide_N] + 1, minlength=num_positions + 1)
           - np.bincount(end_N[wide_N], minlength=num_positions + 1))
  return np.cumsum(steps)[:num_positions]


def _covered(spans_Nx2: np.ndarray, num_bytes: int) -> np.ndarray:
  steps = (np.bincount(spans_Nx2[:, 0], minlength=num_bytes + 1)
           - np.bincount(spans_Nx2[:, 1], minlength=num_bytes + 1))
  return np.cumsum(steps)[:num_bytes] > 0


def _pair_empty(student_spans_Nx2, teacher_spans_Mx2, student_out_N, teacher_out_M, first: int):
  """Pairs the no-byte tokens that sit at one position as many on each side; returns the count
  of groups made (numbered from `first`, to be renumbered into text order by the caller)."""
  s_idx = np.flatnonzero(student_spans_Nx2[:, 0] == student_spans_Nx2[:, 1])
  t_idx = np.flatnonzero(teacher_spans_Mx2[:, 0] == teacher_spans_Mx2[:, 1])
  student_out_N[s_idx] = NO_BYTES
  teacher_out_M[t_idx] = NO_BYTES
  s_pos, t_pos = student_spans_Nx2[s_idx, 0], teacher_spans_Mx2[t_idx, 0]
  made = 0
  for pos in np.intersect1d(s_pos, t_pos):
    s_here, t_here = s_idx[s_pos == pos], t_idx[t_pos == pos]
    if len(s_here) == len(t_here):
      student_out_N[s_here] = teacher_out_M[t_here] = first + made + np.arange(len(s_here))
      made += len(s_here)
  return made


def align_spans(student_spans_Nx2, teacher_spans_Mx2) -> Alignment:
  """Groups of student and teacher tokens covering the same bytes; spans are [start, end) UTF-8
  byte offsets into one text, tokens in text order."""
  student_spans_Nx2 = np.asarray(student_spans_Nx2, np.int64).reshape(-1, 2)
  teacher_spans_Mx2 = np.asarray(teacher_spans_Mx2, np.int64).reshape(-1, 2)
  num_bytes = max(int(max(student_spans_Nx2.max(initial=0), teacher_spans_Mx2.max(initial=0))), 1)
  # A cut at byte p (0 < p < num_bytes) where no token of either side runs across p.
  cut_P = (_straddles(student_spans_Nx2, num_bytes) + _straddles(teacher_spans_Mx2, num_bytes)) == 0
  piece_P = np.cumsum(cut_P)  # the piece of text byte b lies in, pieces split at the cuts
  mismatch_P = _covered(student_spans_Nx2, num_bytes) != _covered(teacher_spans_Mx2, num_bytes)
  piece_mismatch = np.bincount(piece_P, weights=mismatch_P, minlength=num_bytes + 1) > 0
  piece_of_s = piece_P[np.minimum(student_spans_Nx2[:, 0], num_bytes - 1)]
  piece_of_t = piece_P[np.minimum(teacher_spans_Mx2[:, 0], num_bytes - 1)]
  s_has = np.bincount(piece_of_s[student_spans_Nx2[:, 1] > student_spans_Nx2[:, 0]],
                      minlength=num_bytes + 1) > 0
  t_has = np.bincount(piece_of_t[teacher_spans_Mx2[:, 1] > teacher_spans_Mx2[:, 0]],
                      minlength=num_bytes + 1) > 0
  grouped = s_has & t_has & ~piece_mismatch
  group_of_piece = np.where(grouped, np.cumsum(grouped) - 1, UNMATCHED)
  student_out_N = group_of_piece[piece_of_s].astype(np.int32)
  teacher_out_M = group_of_piece[piece_of_t].astype(np.int32)
  num_groups = int(grouped.sum())
  made = _pair_empty(student_spans_Nx2, teacher_spans_Mx2, student_out_N, teacher_out_M,
                     num_groups)
  if made:  # renumber so that groups run in text order
    key = _order_key(student_spans_Nx2, student_out_N, num_groups + made)
    rank = np.empty_like(key)
    rank[np.lexsort((np.arange(len(key)), key))] = np.arange(len(key))
    student_out_N = np.where(student_out_N >= 0, rank[student_out_N], student_out_N)
    teacher_out_M = np.where(teacher_out_M >= 0, rank[teacher_out_M], teacher_out_M)
  return Alignment(student_out_N.astype(np.int32), teacher_out_M.astype(np.int32),
                   num_groups + made)


def _order_key(spans_Nx2, group_N, num_groups) -> np.ndarray:
  """Each group's place in the text: its first token's index on the student side."""
  first = np.full(num_groups, np.iinfo(np.int64).max)
  member = group_N >= 0
  np.minimum.at(first, group_N[member], np.flatnonzero(member))
  return first


def alignment_targets(alignment: Alignment, student_ids_N, teacher_ids_M,
                      teacher_to_student_Vt: np.ndarray, student_mask_N=None) -> dict:
  """What the cross-tokenizer loss reads for one record, per predicting position:

    student_group_N / teacher_group_M  int32  the group of the token position i predicts
                                             (token i + 1), -1 when it is in none or not scored
    group_kind_G                       int32  SKIP, EXACT (one-to-one, same token on both
                                             sides: KL over the shared vocabulary) or SPAN
                                             (span probabilities compared)

  student_mask_N: which student tokens are trained (the loss mask, per token); default all.
  Arrays keep the record's lengths; the batch pads them (groups with -1, kinds with SKIP)."""
  student_ids_N, teacher_ids_M = np.asarray(student_ids_N), np.asarray(teacher_ids_M)
  G = alignment.num_groups
  s_group, t_group = alignment.student_group_N, alignment.teacher_group_M
  scored = np.ones(G, bool)
  for group, mask in ((s_group, student_mask_N), (t_group, None)):
    blocked = np.zeros(len(group), bool)
    blocked[:1] = True                   # the first token is predicted by nothing
    if mask is not None:
      blocked |= ~np.asarray(mask, bool)
    scored[group[blocked & (group >= 0)]] = False
  s_count = np.bincount(s_group[s_group >= 0], minlength=G)
  t_count = np.bincount(t_group[t_group >= 0], minlength=G)
  one_to_one = (s_count == 1) & (t_count == 1)
  same_token = np.zeros(G, bool)
  s_single, t_single = np.flatnonzero(s_group >= 0), np.flatnonzero(t_group >= 0)
  s_token, t_token = np.full(G, -1), np.full(G, -1)
  s_token[s_group[s_single]] = student_ids_N[s_single]
  t_token[t_group[t_single]] = teacher_ids_M[t_single]
  known = (t_token >= 0) & (t_token < len(teacher_to_student_Vt))
  same_token[known] = teacher_to_student_Vt[t_token[known]] == s_token[known]
  kind_G = np.where(~scored, SKIP, np.where(one_to_one & same_token, EXACT, SPAN))

  def shifted(group):
    out = np.full(len(group), -1, np.int32)
    nxt = group[1:]
    out[:-1] = np.where((nxt >= 0) & scored[np.maximum(nxt, 0)], nxt, -1)
    return out

  return {"student_group_N": shifted(s_group), "teacher_group_M": shifted(t_group),
          "group_kind_G": kind_G.astype(np.int32)}
