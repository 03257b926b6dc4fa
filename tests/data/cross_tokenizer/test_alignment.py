"""Byte offsets of tokens, the shared vocabulary, and the byte alignment of two tokenizations."""

import numpy as np
import pytest

from tests.data.chat_testing import corpus_sentences
from tests.support.tokenizers import trained_bpe
from distillax.data.cross_tokenizer.alignment import (EXACT, NO_BYTES, SKIP, SPAN, UNMATCHED, align_spans,
                                            alignment_targets)
from distillax.data.cross_tokenizer.token_bytes import (byte_offsets, encode_with_byte_offsets, shared_vocab,
                                        token_byte_strings)
from distillax.data.tokenizer import ByteTokenizer, make_tokenizer


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory):
  """(512-id, 1024-id) byte-level BPEs trained on the same corpus: different merges."""
  root = tmp_path_factory.mktemp("bpe")
  return tuple(make_tokenizer(f"hf:{trained_bpe(root / str(n), n)}") for n in (512, 1024))


def test_byte_offsets_split_and_fused_characters():
  # "日本": tokenizers reports the three pieces of 日 with 日's character span.
  got = byte_offsets("日本", [(0, 1), (0, 1), (0, 1), (1, 2)], [1, 1, 1, 3])
  assert got.tolist() == [[0, 1], [1, 2], [2, 3], [3, 6]]
  # "aïv": a piece of ï fused with v spans both characters; "a" keeps its own byte.
  got = byte_offsets("aïv", [(0, 1), (1, 2), (1, 3)], [1, 1, 2])
  assert got.tolist() == [[0, 1], [1, 2], [2, 4]]
  # A zero-width token (a special the tokenizer inserted) keeps no bytes.
  got = byte_offsets("é", [(0, 0), (0, 1), (0, 1)], [3, 1, 1])
  assert got.tolist() == [[0, 0], [0, 1], [1, 2]]


def test_hugging_face_byte_offsets_spell_the_text(bpe_pair):
  for tokenizer in bpe_pair:
    spelled = token_byte_strings(tokenizer)
    for text in corpus_sentences(20, seed=3) + ["naïve café 日本 🙂"]:
      ids, offsets = encode_with_byte_offsets(tokenizer, text)
      raw = text.encode("utf-8")
      assert [spelled[i] for i in ids] == [raw[s:e] for s, e in offsets.tolist()]
      assert offsets[0, 0] == 0 and offsets[-1, 1] == len(raw)
      assert (offsets[1:, 0] == offsets[:-1, 1]).all()


def test_shared_vocab_maps_equal_byte_strings(bpe_pair):
  small, large = bpe_pair
  shared = shared_vocab(small, large)
  small_bytes, large_bytes = token_byte_strings(small), token_byte_strings(large)
  assert len(shared.student_ids_S) == len(set(small_bytes) & set(large_bytes))
  assert all(small_bytes[s] == large_bytes[t]
             for s, t in zip(shared.student_ids_S.tolist(), shared.teacher_ids_S.tolist()))
  unshared = np.flatnonzero(shared.teacher_to_student_Vt < 0)
  assert len(unshared) > 0 and not set(large_bytes[i] for i in unshared) & set(small_bytes)
  byte_tok = ByteTokenizer()
  byte_shared = shared_vocab(byte_tok, small)
  # Every byte and the three specials (spelled "<pad>", "<s>", "</s>" on both sides).
  assert len(byte_shared.student_ids_S) == 259
  assert byte_shared.teacher_to_student_Vt[small.eos_id] == byte_tok.eos_id


def _groups(student, teacher):
  return align_spans(np.array(student).reshape(-1, 2), np.array(teacher).reshape(-1, 2))


def test_one_to_one_merges_and_splits():
  # "abcd": a|b|cd against a|bc|d -> [a]=[a], [b, cd]=[bc, d].
  alignment = _groups([(0, 1), (1, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)])
  assert alignment.groups() == [((0,), (0,)), ((1, 2), (1, 2))]
  # A student merge (one to many) and a student split (many to one).
  alignment = _groups([(0, 3), (3, 4), (4, 5)], [(0, 1), (1, 2), (2, 3), (3, 5)])
  assert alignment.groups() == [((0,), (0, 1, 2)), ((1, 2), (3,))]
  assert alignment.left_out(UNMATCHED) == alignment.left_out(NO_BYTES) == ((), ())


def test_bos_on_one_side_and_eos_on_both():
  # Student: <s> "ab" "c" </s>; teacher: "a" "bc" </s> (no BOS).
  alignment = _groups([(0, 0), (0, 2), (2, 3), (3, 3)], [(0, 1), (1, 3), (3, 3)])
  assert alignment.groups() == [((1, 2), (0, 1)), ((3,), (2,))]
  assert alignment.left_out(NO_BYTES) == ((0,), ())
  # Two EOS on the student side, one on the teacher's: nothing pairs at that position.
  alignment = _groups([(0, 1), (1, 1), (1, 1)], [(0, 1), (1, 1)])
  assert alignment.groups() == [((0,), (0,))]
  assert alignment.left_out(NO_BYTES) == ((1, 2), (1,))
  # A separator on both sides mid-text pairs off in its place in the text.
  alignment = _groups([(0, 1), (1, 1), (1, 3)], [(0, 1), (1, 1), (1, 2), (2, 3)])
  assert alignment.groups() == [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))]


def test_bytes_one_side_drops_are_unmatched():
  # "a b": the teacher's tokenizer drops the space.
  alignment = _groups([(0, 1), (1, 2), (2, 3)], [(0, 1), (2, 3)])
  assert alignment.groups() == [((0,), (0,)), ((2,), (1,))]
  assert alignment.left_out(UNMATCHED) == ((1,), ())


def test_unicode_bytes_against_characters():
  # "naïve café 日本": the byte tokenizer against a character-level split of the same text.
  text = "naïve café 日本"
  _, student = encode_with_byte_offsets(ByteTokenizer(), text)
  widths = np.array([len(c.encode()) for c in text])
  ends = np.cumsum(widths)
  teacher = np.stack([ends - widths, ends], axis=-1)
  alignment = align_spans(student, teacher)
  groups = alignment.groups()
  assert len(groups) == len(text)
  assert [len(s) for s, _ in groups] == widths.tolist()  # ï, é: 2 bytes; 日, 本: 3 bytes
  assert groups[2] == ((2, 3), (2,)) and groups[-1] == ((16, 17, 18), (12,))


def _reference_groups(student_spans, teacher_spans):
  """Two pointers over fully covering spans (TRL's walk): close a group where both sides end
  at the same byte."""
  groups, s0, t0, s, t = [], 0, 0, 0, 0
  while s < len(student_spans) and t < len(teacher_spans):
    s_end, t_end = student_spans[s][1], teacher_spans[t][1]
    s, t = s + (s_end <= t_end), t + (t_end <= s_end)
    if s_end == t_end:
      groups.append((tuple(range(s0, s)), tuple(range(t0, t))))
      s0, t0 = s, t
  return groups


def test_two_trained_tokenizers_match_a_two_pointer_walk(bpe_pair):
  small, large = bpe_pair
  differ = 0
  for text in corpus_sentences(40, seed=5):
    _, student = encode_with_byte_offsets(small, text)
    _, teacher = encode_with_byte_offsets(large, text)
    alignment = align_spans(student, teacher)
    groups = alignment.groups()
    assert groups == _reference_groups(student.tolist(), teacher.tolist())
    differ += sum(len(s) + len(t) > 2 for s, t in groups)
    for s, t in groups:  # the same bytes on both sides
      assert (student[s[0], 0], student[s[-1], 1]) == (teacher[t[0], 0], teacher[t[-1], 1])
  assert differ > 10  # the merges differ enough to make many-token groups


def test_alignment_targets_shift_and_kinds():
  # Student: <s> "a" "bc" </s>; teacher: <s> "a" "b" "c" </s>; ids spell the same where shown.
  alignment = _groups([(0, 0), (0, 1), (1, 3), (3, 3)],
                      [(0, 0), (0, 1), (1, 2), (2, 3), (3, 3)])
  assert alignment.groups() == [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3)), ((3,), (4,))]
  teacher_to_student = np.array([10, 11, 12, 13, 14, -1, -1, 15])  # teacher id -> student id
  targets = alignment_targets(alignment, [10, 11, 40, 15], [0, 1, 5, 6, 7], teacher_to_student)
  # <s> is predicted by nothing (skipped); "a" maps; "bc" / "b" "c" is a span; </s> maps.
  assert targets["group_kind_G"].tolist() == [SKIP, EXACT, SPAN, EXACT]
  assert targets["student_group_N"].tolist() == [1, 2, 3, -1]
  assert targets["teacher_group_M"].tolist() == [1, 2, 2, 3, -1]
  # A loss mask that leaves out "a" skips its group on both sides.
  masked = alignment_targets(alignment, [10, 11, 40, 15], [0, 1, 5, 6, 7], teacher_to_student,
                             student_mask_N=[1, 0, 1, 1])
  assert masked["group_kind_G"].tolist() == [SKIP, SKIP, SPAN, EXACT]
  assert masked["teacher_group_M"].tolist() == [-1, 2, 2, 3, -1]
  # An empty text: <s> </s> on both sides pair off; nothing on either side: no groups.
  empty = _groups([(0, 0), (0, 0)], [(0, 0), (0, 0)])
  assert empty.groups() == [((0,), (0,)), ((1,), (1,))]
  assert alignment_targets(empty, [1, 2], [1, 2], np.arange(3))["group_kind_G"].tolist() == [
      SKIP, EXACT]
  nothing = align_spans(np.zeros((0, 2)), np.zeros((0, 2)))
  assert nothing.num_groups == 0
  assert alignment_targets(nothing, [], [], np.arange(3))["group_kind_G"].tolist() == []
