"""Cross-tokenizer rows: each row holds the same bytes on both sides, the rows of a document
give back both whole tokenizations, and the iterator resumes exactly from its state."""

import numpy as np
import pytest

from distillax.data.cross_tokenizer import rows
from distillax.data.cross_tokenizer.pipeline import make_cross_tokenizer_train_iterator
from distillax.data.cross_tokenizer.alignment import EXACT, SPAN
from distillax.data.cross_tokenizer.token_bytes import shared_vocab, token_byte_strings
from distillax.data.tokenizer import make_tokenizer
from tests.data.chat_testing import corpus_sentences
from tests.support.tokenizers import trained_bpe


@pytest.fixture(scope="module")
def bpes(tmp_path_factory):
  root = tmp_path_factory.mktemp("bpe")
  student = make_tokenizer("hf:" + trained_bpe(root / "s", 512))
  teacher = make_tokenizer("hf:" + trained_bpe(root / "t", 1024))
  return student, teacher, shared_vocab(student, teacher).teacher_to_student_Vt


def _spelled(tokenizer, ids) -> bytes:
  spell = token_byte_strings(tokenizer)
  return b"".join(spell[i] for i in ids if i not in (tokenizer.bos_id, tokenizer.eos_id))


def test_rows_cut_both_sides_at_one_byte_and_give_back_the_document(bpes):
  student, teacher, to_student = bpes
  text = "\n".join(corpus_sentences(40, seed=3))  # ASCII with é, €, 中文 mixed in
  cut = rows.CrossTokenizeDocument(student, teacher, to_student, seq_len=24, teacher_seq_len=20,
                                   add_bos=True)
  out = cut.map(text)
  assert len(out) > 5
  s_all, t_all = [], []
  for row in out:
    s_n, t_n = int(row["segment_ids_BxL"].sum()), int(row[rows.TEACHER_SEGMENT_IDS].sum())
    assert s_n <= 24 and t_n <= 20
    s_ids = np.append(row["inputs_BxL"][:s_n], row["targets_BxL"][s_n - 1])
    t_ids = np.append(row[rows.TEACHER_INPUTS][:t_n], row[rows.TEACHER_TARGETS][t_n - 1])
    assert _spelled(student, s_ids) == _spelled(teacher, t_ids)  # the same bytes
    kinds = row[rows.GROUP_KIND]
    assert (kinds == EXACT).any()
    # Every scored position predicts a token of a group that is scored on both sides.
    for group_key in (rows.STUDENT_GROUP, rows.TEACHER_GROUP):
      groups = row[group_key][row[group_key] >= 0]
      assert np.isin(kinds[groups], (EXACT, SPAN)).all()
      assert set(groups.tolist()) == set(np.flatnonzero(np.isin(kinds, (EXACT, SPAN))).tolist())
    s_all.extend(s_ids.tolist())
    t_all.extend(t_ids.tolist())
  whole_s = [student.bos_id, *student.encode_array(text).tolist(), student.eos_id]
  whole_t = [teacher.bos_id, *teacher.encode_array(text).tolist(), teacher.eos_id]
  assert s_all == whole_s and t_all == whole_t


def test_iterator_resumes_from_its_state(bpes, tmp_path):
  student, teacher, to_student = bpes
  for i in range(6):
    (tmp_path / f"doc{i}.txt").write_text("\n".join(corpus_sentences(8, seed=i)))
  kwargs = dict(global_batch_size=4, seq_len=16, teacher_seq_len=16, student=student,
                teacher=teacher, teacher_to_student_Vt=to_student, process_index=0,
                process_count=1)
  data = {"source": str(tmp_path / "*.txt"), "validation_fraction": 0.0, "shuffle_buffer": 8,
          "read_threads": 1}
  it = make_cross_tokenizer_train_iterator(data, seed=0, **kwargs)
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(2)]
  again = make_cross_tokenizer_train_iterator(data, seed=0, **kwargs)
  again.set_state(state)
  for want in expected:
    got = next(again)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
