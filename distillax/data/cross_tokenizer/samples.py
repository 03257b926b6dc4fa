"""The teacher's side of the student's own samples (cross-tokenizer on-policy distillation).

Between sampling and scoring, on the host: each sampled sequence (prompt + completion, student
ids) becomes text, the teacher's tokenizer cuts that text, and the two cuts are aligned by their
bytes with the off-policy code (data.token_alignment: align_spans, alignment_targets). Only the
completion's tokens are trained, so a group that holds a prompt token is not scored.

The text is the student's tokens' byte strings end to end (data.token_bytes), not a re-encoding:
what the student wrote, cut where it cut it. Special tokens (BOS, EOS, end of turn) take no
bytes; a student BOS at the start and an EOS at the end get the teacher's own, so they pair off
as in the off-policy rows. Sampled bytes need not be valid UTF-8 (a byte-level BPE can stop in
the middle of a character): invalid runs become U+FFFD in the text, and the student tokens that
touch them are not trained (the teacher never saw those bytes). With one tokenizer on both sides
the teacher's tokens are the sampled ones themselves (re-encoding might cut the text otherwise),
so every completion token is trained and every group is one to one and exact, as in ordinary
on-policy distillation.

Layout, per prompt row b and sample s, the arrays the step reads ([B, S, ...]):
  the teacher's tokens left-aligned in M = teacher_len slots (data.cross_tokenizer_rows' TEACHER_*
  keys and TEACHER_GROUP), the student's group per scoring position in on-policy's scoring
  layout (prompt right-aligned in P slots, completion after it: P + T - 1 inputs), and each
  group's kind in P + T slots. A teacher cut longer than M + 1 tokens is cut there; the student
  tokens past it are unmatched (not scored).
"""

from __future__ import annotations

import numpy as np

from distillax.data.cross_tokenizer import rows
from distillax.data.cross_tokenizer.alignment import SKIP, align_spans, alignment_targets
from distillax.data.cross_tokenizer.token_bytes import BYTE_SPECIALS, encode_with_byte_offsets, token_byte_strings
from distillax.data.tokenizer import HuggingFaceTokenizer, Tokenizer

_REPLACEMENT_BYTES = len("\ufffd".encode("utf-8"))


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
  """Ids that spell no text: BOS, EOS and the tokenizer's special added tokens."""
  ids = {i for i in (tokenizer.bos_id, tokenizer.eos_id) if i is not None}
  if isinstance(tokenizer, HuggingFaceTokenizer):
    ids |= {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
  elif tokenizer.vocab_size > max(BYTE_SPECIALS):
    ids |= set(BYTE_SPECIALS)
  return frozenset(ids)


def readable_text(raw: bytes) -> tuple[str, np.ndarray, np.ndarray]:
  """(text, where each byte offset 0..len(raw) lands in the text's UTF-8 bytes [len + 1], which
  raw bytes were not valid UTF-8 [len]): invalid runs become U+FFFD."""
  pieces, where, bad = [], np.zeros(len(raw) + 1, np.int64), np.zeros(len(raw), bool)
  start, written = 0, 0
  while True:
    try:
      pieces.append(raw[start:].decode("utf-8"))
      stop = end = len(raw)
    except UnicodeDecodeError as e:
      stop, end = start + e.start, start + e.end
      pieces.append(raw[start:stop].decode("utf-8"))
    where[start:stop + 1] = written + np.arange(stop - start + 1)
    written += stop - start
    if stop == len(raw):
      return "".join(pieces), where, bad
    bad[stop:end] = True
    pieces.append("\ufffd")
    written += _REPLACEMENT_BYTES
    where[stop + 1:end + 1] = written
    start = end


class SampleAligner:
  """Sampled student sequences -> the teacher's tokens and the alignment (see the module doc).

  same_tokenizer: the teacher's tokenizer is the student's (its tokens are the sampled ones)."""

  def __init__(self, student: Tokenizer, teacher: Tokenizer, teacher_to_student_Vt: np.ndarray,
               *, prompt_width: int, new_tokens: int, teacher_len: int, same_tokenizer: bool):
    self.student, self.teacher = student, teacher
    self.teacher_to_student_Vt = np.asarray(teacher_to_student_Vt)
    self.P, self.T, self.M = int(prompt_width), int(new_tokens), int(teacher_len)
    self.same = bool(same_tokenizer)
    spelled = token_byte_strings(student)
    self.specials = special_ids(student)
    self.byte_len_V = np.array([0 if i in self.specials else len(spelled[i] or b"")
                                for i in range(len(spelled))], np.int64)
    self.spelled = spelled

  def shapes(self, num_samples: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{key: (shape after the batch dim, dtype)} of what __call__ returns."""
    S, M, L, G = int(num_samples), self.M, self.P + self.T - 1, self.P + self.T
    i32 = np.dtype(np.int32)
    return {**{k: ((S, M), i32) for k in (*rows.TEACHER_KEYS, rows.TEACHER_GROUP)},
            rows.STUDENT_GROUP: ((S, L), i32), rows.GROUP_KIND: ((S, G), i32)}

  def __call__(self, prompt_tokens_BxP, prompt_lengths_B, completion_BxSxT,
               completion_lengths_BxS) -> dict[str, np.ndarray]:
    B, S = np.shape(completion_lengths_BxS)
    out = {k: np.zeros((B,) + shape, dtype) for k, (shape, dtype) in self.shapes(S).items()}
    out[rows.TEACHER_INPUTS][:] = out[rows.TEACHER_TARGETS][:] = self.teacher.pad_id
    out[rows.STUDENT_GROUP][:] = out[rows.TEACHER_GROUP][:] = -1
    out[rows.GROUP_KIND][:] = SKIP
    for b in range(B):
      n_prompt = int(prompt_lengths_B[b])
      if n_prompt < 1:
        continue  # an empty row: nothing is scored
      for s in range(S):
        completion = np.asarray(completion_BxSxT[b, s][:int(completion_lengths_BxS[b, s])])
        self._fill(out, b, s, np.asarray(prompt_tokens_BxP[b][:n_prompt]), completion)
    return out

  def _student_spans(self, ids_N: np.ndarray):
    """(text, byte spans [N, 2], trainable [N]) of the sampled ids."""
    ends_N = np.cumsum(self.byte_len_V[ids_N])
    spans_Nx2 = np.stack([ends_N - self.byte_len_V[ids_N], ends_N], axis=-1)
    raw = b"".join(self.spelled[i] or b"" for i in ids_N.tolist() if i not in self.specials)
    text, where, bad = readable_text(raw)
    bad_before = np.concatenate([[0], np.cumsum(bad)])
    readable_N = bad_before[spans_Nx2[:, 1]] == bad_before[spans_Nx2[:, 0]]
    return text, where[spans_Nx2], readable_N

  def _teacher_side(self, ids_N, text: str, spans_Nx2):
    if self.same:
      return ids_N, spans_Nx2
    t_ids, t_spans = encode_with_byte_offsets(self.teacher, text)
    t_ids, t_spans = np.asarray(t_ids, np.int32), np.asarray(t_spans, np.int64).reshape(-1, 2)
    end = len(text.encode("utf-8"))
    if self.student.bos_id is not None and ids_N[0] == self.student.bos_id and (
        self.teacher.bos_id is not None):
      t_ids, t_spans = np.concatenate([[self.teacher.bos_id], t_ids]), np.concatenate(
          [[[0, 0]], t_spans])
    if self.student.eos_id is not None and ids_N[-1] == self.student.eos_id and (
        self.teacher.eos_id is not None):
      t_ids, t_spans = np.concatenate([t_ids, [self.teacher.eos_id]]), np.concatenate(
          [t_spans, [[end, end]]])
    keep = self.M + 1
    return t_ids[:keep].astype(np.int32), t_spans[:keep]

  def _fill(self, out, b: int, s: int, prompt_N: np.ndarray, completion_N: np.ndarray):
    ids_N = np.concatenate([prompt_N, completion_N]).astype(np.int32)
    text, s_spans, readable_N = self._student_spans(ids_N)
    t_ids, t_spans = self._teacher_side(ids_N, text, s_spans)
    trained_N = (readable_N | self.same) & (np.arange(len(ids_N)) >= len(prompt_N))
    alignment = align_spans(s_spans, t_spans)
    targets = alignment_targets(alignment, ids_N, t_ids, self.teacher_to_student_Vt,
                                student_mask_N=trained_N)
    # Scoring layout: prompt token k at slot P - len(prompt) + k, completion token c at P + c;
    # slot p predicts the token at p + 1, so it reads the group of the token after its own.
    slot_N = np.concatenate([self.P - len(prompt_N) + np.arange(len(prompt_N)),
                             self.P + np.arange(len(completion_N))])
    out[rows.STUDENT_GROUP][b, s, slot_N[:-1]] = targets["student_group_N"][:-1]
    n = max(len(t_ids) - 1, 0)
    out[rows.TEACHER_INPUTS][b, s, :n], out[rows.TEACHER_TARGETS][b, s, :n] = (t_ids[:-1],
                                                                               t_ids[1:])
    out[rows.TEACHER_SEGMENT_IDS][b, s, :n] = 1
    out[rows.TEACHER_POSITIONS][b, s, :n] = np.arange(n, dtype=np.int32)
    out[rows.TEACHER_GROUP][b, s, :n] = targets["teacher_group_M"][:n]
    kinds = targets["group_kind_G"]
    out[rows.GROUP_KIND][b, s, :len(kinds)] = kinds
