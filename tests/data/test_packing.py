"""Packing: rows equal an independent reference packer, and documents come back byte for byte."""

import collections

import numpy as np
import pytest

from tests.data.data_testing import (byte_ids, check_row_invariants, data_config, random_texts,
                                     reconstruct_documents, write_text_files)
from distillax.data import BATCH_KEYS, ByteTokenizer, make_eval_iterator, make_train_iterator


def reference_rows(docs_ids, seq_len, pad_id=0, docs_masks=None):
  """Lay every (token, next token) pair of every document end to end, cut into rows of seq_len;
  a new segment starts where the document changes or a row starts. With `docs_masks` (a 0/1
  per token of each document) a pair's loss mask is its target token's; else 1."""
  if docs_masks is None:
    docs_masks = [[1.0] * len(ids) for ids in docs_ids]
  pairs = [(ids[i], ids[i + 1], d, docs_masks[d][i + 1]) for d, ids in enumerate(docs_ids)
           for i in range(len(ids) - 1)]
  rows = collections.defaultdict(list)
  for start in range(0, len(pairs), seq_len):
    chunk = pairs[start:start + seq_len]
    inputs = np.full(seq_len, pad_id, np.int32)
    targets = np.full(seq_len, pad_id, np.int32)
    seg = np.zeros(seq_len, np.int32)
    pos = np.zeros(seq_len, np.int32)
    loss_mask = np.zeros(seq_len, np.float32)
    segment, seg_start, prev_doc = 0, 0, None
    for j, (a, b, d, m) in enumerate(chunk):
      if d != prev_doc:
        segment, seg_start, prev_doc = segment + 1, j, d
      inputs[j], targets[j], seg[j], pos[j], loss_mask[j] = a, b, segment, j - seg_start, m
    for key, value in zip(BATCH_KEYS, (inputs, targets, seg, pos, loss_mask)):
      rows[key].append(value)
  return {k: np.stack(v) for k, v in rows.items()}


def eval_batches(folder, *, batch, seq_len, **kw):
  cfg = data_config(source=folder, eval_source=folder, **kw)
  return list(make_eval_iterator(cfg, global_batch_size=batch, seq_len=seq_len,
                                 process_index=0, process_count=1))


@pytest.mark.parametrize("seq_len,batch", [(16, 3), (7, 2), (200, 1)])
def test_rows_equal_reference_packer(corpus, seq_len, batch):
  folder, texts = corpus
  batches = eval_batches(folder, batch=batch, seq_len=seq_len)
  got = {k: np.concatenate([b[k] for b in batches]) for k in BATCH_KEYS}
  want = reference_rows([byte_ids(t) for t in texts], seq_len)
  # The final batch is topped up with empty rows to the full batch size.
  extra = len(got["inputs_BxL"]) - len(want["inputs_BxL"])
  assert 0 <= extra < batch
  for key in BATCH_KEYS:
    assert got[key].dtype == want[key].dtype, key
    np.testing.assert_array_equal(got[key][:len(want[key])], want[key], err_msg=key)
    assert not got["segment_ids_BxL"][len(want[key]):].any()
  for b in batches:
    check_row_invariants(b)


def test_documents_come_back_exactly(corpus):
  folder, texts = corpus
  batches = eval_batches(folder, batch=4, seq_len=24)
  tokenizer = ByteTokenizer()
  docs = reconstruct_documents(batches, eos_id=tokenizer.eos_id)
  want = [t for t in texts if t]  # empty files are skipped
  assert [tokenizer.decode(d) for d in docs] == want
  assert [d for d in docs] == [byte_ids(t) for t in want]


def test_every_in_document_pair_counted_once_and_none_across(corpus):
  folder, texts = corpus
  batches = eval_batches(folder, batch=2, seq_len=13)
  counted = collections.Counter()
  for b in batches:
    m = b["loss_mask_BxL"] > 0
    counted.update(zip(b["inputs_BxL"][m].tolist(), b["targets_BxL"][m].tolist()))
  want = collections.Counter()
  for t in texts:
    ids = byte_ids(t)
    want.update(zip(ids[:-1], ids[1:]))
  assert counted == want
  # EOS is never an input and BOS never a target: no pair joins two documents.
  inputs = np.concatenate([b["inputs_BxL"][b["loss_mask_BxL"] > 0] for b in batches])
  targets = np.concatenate([b["targets_BxL"][b["loss_mask_BxL"] > 0] for b in batches])
  assert not np.any(inputs == 1) and not np.any(targets == 2)


def test_without_bos(corpus):
  folder, texts = corpus
  batches = eval_batches(folder, batch=3, seq_len=16, add_bos=False)
  want = reference_rows([byte_ids(t)[1:] for t in texts], 16)
  got = np.concatenate([b["inputs_BxL"] for b in batches])[:len(want["inputs_BxL"])]
  np.testing.assert_array_equal(got, want["inputs_BxL"])


def test_row_shuffle_is_a_permutation_of_unshuffled_rows(tmp_path):
  texts = random_texts(30, seed=3, min_len=5)
  folder = str(tmp_path / "c")
  write_text_files(folder, texts)

  def rows(shuffle_buffer):
    cfg = data_config(source=folder, validation_fraction=0.0, num_epochs=1,
                      shuffle_buffer=shuffle_buffer)
    it = make_train_iterator(cfg, global_batch_size=2, seq_len=16, seed=5,
                             process_index=0, process_count=1)
    batches = list(it)
    for b in batches:
      check_row_invariants(b)
    return np.concatenate([np.concatenate([b[k] for k in BATCH_KEYS[:4]], axis=1)
                           for b in batches])

  plain, shuffled = rows(0), rows(32)
  assert not np.array_equal(plain, shuffled)
  key = lambda r: r.tobytes()
  assert sorted(map(key, plain)) == sorted(map(key, shuffled))


@pytest.mark.parametrize("seq_len,batch", [(16, 3), (61, 2), (300, 1)])
def test_chat_rows_keep_the_assistant_masks(tmp_path, seq_len, batch):
  """Chat records packed: rows equal the reference packer fed transformers' own token ids and
  assistant masks of the same chats; a chat with no assistant turn is skipped."""
  from tests.data import chat_testing as ct
  folder = ct.save_tokenizer(tmp_path / "tok", ct.CHATML_TAGGED)
  chats = ct.conversations(9, seed=4)
  chats.insert(3, [{"role": "user", "content": "a question nobody answers"}])
  source = ct.write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in chats])
  cfg = data_config(source=source, eval_source=source, tokenizer=f"hf:{folder}")
  batches = list(make_eval_iterator(cfg, global_batch_size=batch, seq_len=seq_len,
                                    process_index=0, process_count=1))
  hf = ct.load_hf(folder)
  encodings = [hf.apply_chat_template(m, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True) for m in chats]
  kept = [e for e in encodings if any(e["assistant_masks"])]
  assert len(kept) == len(chats) - 1
  want = reference_rows([list(e["input_ids"]) for e in kept], seq_len, pad_id=hf.pad_token_id,
                        docs_masks=[[float(x) for x in e["assistant_masks"]] for e in kept])
  got = {k: np.concatenate([b[k] for b in batches]) for k in BATCH_KEYS}
  rows = len(want["inputs_BxL"])
  assert 0 <= len(got["inputs_BxL"]) - rows < batch
  for key in BATCH_KEYS:
    np.testing.assert_array_equal(got[key][:rows], want[key], err_msg=key)
  assert not got["loss_mask_BxL"][rows:].any() and not got["segment_ids_BxL"][rows:].any()
  assert 0 < got["loss_mask_BxL"].sum() < (got["segment_ids_BxL"] > 0).sum()
