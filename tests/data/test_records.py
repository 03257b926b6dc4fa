"""JSONL and Parquet records in each Hugging Face layout: read lazily, sharded per process,
resumable exactly, and tokenized as transformers tokenizes the same chats."""

import json
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from tests.data import chat_testing as ct
from tests.data.data_testing import (data_config, orbax_save_args, random_texts,
                                     save_iterator_state)
from distillax import data
from distillax.data import ChatRecord, PromptCompletion, load_documents
from distillax.data.chat import prepare_messages
from distillax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRITERS = {"jsonl": ct.write_jsonl, "parquet": ct.write_parquet}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  """A tokenizer whose template starts every chat with BOS (so packed chats can be told apart)
  and marks assistant turns with generation tags (so transformers gives the expected mask)."""
  return ct.save_tokenizer(tmp_path_factory.mktemp("llama"), ct.LLAMA3_TAGGED)


def layout_rows():
  """(rows, the documents they hold) for every layout; prompt/completion in both TRL forms."""
  texts = random_texts(5, seed=11, min_len=1)
  chats = ct.conversations(5, seed=12)
  rows, docs = [], []
  for t in texts:
    rows.append({"text": t, "id": len(rows)})
    docs.append(t)
  for m in chats:
    rows.append({"messages": m, "id": len(rows)})
    docs.append(ChatRecord(tuple(m)))
  for i, m in enumerate(chats[:3]):
    rows.append({"prompt": m[0]["content"], "completion": m[-1]["content"], "id": len(rows)})
    docs.append(PromptCompletion(m[0]["content"], m[-1]["content"]))
    completion = m[-1:] if i % 2 else m[-1]["content"]  # a list of messages, or a string
    rows.append({"prompt": m[:-1], "completion": completion, "id": len(rows)})
    docs.append(ChatRecord(tuple(m), prompt_messages=len(m) - 1))
  return rows, docs


def same_document(got, want):
  """Equal documents; chats compared as the template sees them (Parquet fills the keys a
  message lacks with nulls, which transformers and distillax drop)."""
  if isinstance(want, ChatRecord):
    return (isinstance(got, ChatRecord) and got.prompt_messages == want.prompt_messages
            and prepare_messages(got.messages) == prepare_messages(want.messages))
  return got == want


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_every_layout_in_every_format(tmp_path, fmt):
  rows, docs = layout_rows()
  if fmt == "parquet":  # one type per Parquet column: a file per layout, read in path order
    pc_str = [r for r in rows[10:] if isinstance(r["prompt"], str)]
    pc_chat = [dict(r) for r in rows[10:] if not isinstance(r["prompt"], str)]
    for r in pc_chat:
      if isinstance(r["completion"], str):
        r["completion"] = [{"role": "assistant", "content": r["completion"]}]
    for i, part in enumerate([rows[:5], rows[5:10], pc_str, pc_chat]):
      ct.write_parquet(tmp_path / f"part{i}.parquet", part)
    docs = docs[:10] + [d for d in docs[10:] if isinstance(d, PromptCompletion)] + \
        [d for d in docs[10:] if isinstance(d, ChatRecord)]
  else:
    ct.write_jsonl(tmp_path / "all.jsonl", rows)
  documents = load_documents(str(tmp_path))
  got = [documents[i] for i in range(len(documents))]
  assert len(got) == len(docs)
  for i, (g, w) in enumerate(zip(got, docs)):
    assert same_document(g, w), (i, g, w)
  key = documents.all_keys()[6]
  assert key == ("part1.parquet:1" if fmt == "parquet" else "all.jsonl:6")
  train, validation = documents.split(0.3)
  assert sorted(train.all_keys() + validation.all_keys()) == sorted(documents.all_keys())


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_named_layouts_and_fields(tmp_path, fmt):
  chats = ct.conversations(3, seed=2)
  path = WRITERS[fmt](tmp_path / f"c.{fmt}",
                      [{"conversation": m, "body": "t" * (i + 1)} for i, m in enumerate(chats)])
  layout = data.RecordLayout("messages", messages_field="conversation")
  docs = load_documents(path, layout=layout)
  assert all(same_document(docs[i], ChatRecord(tuple(m))) for i, m in enumerate(chats))
  docs = load_documents(path, layout=data.RecordLayout("text", text_field="body"))
  assert [docs[i] for i in range(3)] == ["t", "tt", "ttt"]
  # auto finds neither 'messages' nor 'text' nor a prompt/completion pair: the error says so.
  if fmt == "parquet":
    with pytest.raises(UserError, match=r"c\.parquet: no column for data.layout='auto'.*the "
                                        r"file has conversation, body"):
      load_documents(path)
  else:
    with pytest.raises(UserError, match=r"c\.jsonl: line 1 has no string field 'text', no "
                                        r"'messages' list.*fields: body, conversation"):
      load_documents(path)[0]
  # A named layout makes every record need its fields.
  with pytest.raises(UserError, match=r"(line 1|row 0) has no string field 'conversation'"):
    load_documents(path, layout=data.RecordLayout("text", text_field="conversation"))[0]


def test_bad_messages_name_the_record(tmp_path):
  path = ct.write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"content": "no role"}]},
                                               {"messages": []}, {"prompt": 3, "completion": 4}])
  docs = load_documents(path)
  with pytest.raises(UserError, match=r"m\.jsonl: line 1: message 0 of 'messages' is not an "
                                      r"object with a string 'role'"):
    docs[0]
  with pytest.raises(UserError, match=r"line 2: 'messages' must be a non-empty list"):
    load_documents(path, layout=data.RecordLayout("messages"))[1]
  with pytest.raises(UserError, match=r"line 3: 'prompt' and 'completion' must be two strings"):
    docs[2]


def test_a_line_that_is_not_utf8_is_named_by_its_line(tmp_path):
  """Line numbers are the file's (blank lines count, as an editor counts them), whatever the
  record's index; the byte at fault and the fix are in the one line."""
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(b'{"text": "fine"}\n\n{"text": "caf\xe9"}\n')
  docs = load_documents(str(path))
  assert docs[0] == "fine"
  with pytest.raises(UserError) as raised:
    docs[1]
  message = str(raised.value)
  assert message.startswith(f"{path}: line 3 is not UTF-8 text (byte 14 of the line is b'\\xe9')")
  assert "re-encode the file" in message and "\n" not in message
  # The same line seen from the pipeline's threads.
  it = data.make_eval_iterator(data_config(source=str(path), eval_source=str(path)),
                               global_batch_size=1, seq_len=8, process_index=0, process_count=1)
  with pytest.raises(UserError, match="line 3 is not UTF-8"):
    list(it)


@pytest.mark.parametrize("role,fix", [("bot", "rename it to 'assistant'"),
                                      ("Human", "rename it to 'user'"),
                                      ("narrator", "rename it to one of these")])
def test_an_unknown_role_lists_the_roles(tmp_path, role, fix):
  chat = [{"role": "user", "content": "hi"}, {"role": role, "content": "hello"}]
  for layout in ("messages", "prompt_completion"):
    row = ({"messages": chat} if layout == "messages" else
           {"prompt": chat[:1], "completion": chat[1:]})
    path = ct.write_jsonl(tmp_path / f"{layout}.jsonl", [row])
    with pytest.raises(UserError) as raised:
      load_documents(path)[0]
    field = "messages" if layout == "messages" else "completion"
    i = 1 if layout == "messages" else 0
    assert str(raised.value) == (
        f"{path}: line 1: message {i} of {field!r} has role {role!r}; a chat's roles are "
        f"system, developer, user, assistant, tool, ipython (the assistant's turns are "
        f"trained): {fix}")


# ---- laziness -----------------------------------------------------------------------------------

def test_jsonl_reader_holds_an_index_not_the_records(tmp_path):
  count, width = 3000, 1000
  path = ct.write_jsonl(tmp_path / "big.jsonl",
                        [{"text": f"{i:06d}" + "x" * width} for i in range(count)])
  tracemalloc.start()
  try:
    before = tracemalloc.get_traced_memory()[0]
    docs = load_documents(path)
    held = tracemalloc.get_traced_memory()[0] - before
  finally:
    tracemalloc.stop()
  assert len(docs) == count
  assert held < 64 * count < os.path.getsize(path) / 10  # O(index): bytes per record, not text
  # A record is read from the file when asked for: rewrite one in place and read it again.
  with open(path, "r+b") as f:
    f.seek(int(docs.parts[0].starts[1234]) + len('{"text": "'))
    f.write(b"REWRITTEN")
  assert docs[1234].startswith("REWRITTEN") and docs[1233].startswith("001233")


def test_parquet_reader_decodes_one_row_group_at_a_time(tmp_path, monkeypatch):
  import gc
  import pyarrow as pa
  import pyarrow.parquet as pq
  from distillax.data import records
  rows = [{"text": f"{i:05d}" + "y" * 2000, "other": "z" * 3000} for i in range(1000)]
  path = ct.write_parquet(tmp_path / "big.parquet", rows, row_group_size=25)
  whole = pq.read_table(path, columns=["text"]).nbytes
  group = pq.ParquetFile(path).read_row_group(0, columns=["text"]).nbytes
  decoded, read_row_group = [], pq.ParquetFile.read_row_group

  def counting(self, index, columns=None, **kwargs):
    if self.metadata.num_rows == len(rows):  # this file, not one another test left reading
      decoded.append((index, tuple(columns)))
    return read_row_group(self, index, columns=columns, **kwargs)

  monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
  gc.collect()
  base = pa.total_allocated_bytes()
  docs = load_documents(path)
  for i in range(len(docs)):
    assert docs[i] == rows[i]["text"]
  # One pass in order decodes each row group once, and only the column the layout reads...
  assert decoded == [(g, ("text",)) for g in range(len(rows) // 25)]
  # ...and what stays decoded is the reader's few cached groups (plus buffer alignment), not
  # the file.
  gc.collect()
  assert pa.total_allocated_bytes() - base <= (records.ROW_GROUP_CACHE + 1) * group < whole / 10


# ---- sharding and resume through the pipeline ---------------------------------------------------

def chat_source(tmp_path, fmt, count=14):
  chats = ct.conversations(count, seed=21)
  rows = [{"messages": m} for m in chats]
  return WRITERS[fmt](tmp_path / f"chats.{fmt}", rows), chats


def expected_documents(llama_dir, chats):
  """transformers' ids and assistant masks of each chat, as (tokens, mask of each token)."""
  hf = ct.load_hf(llama_dir)
  out = []
  for m in chats:
    enc = hf.apply_chat_template(m, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    out.append((tuple(enc["input_ids"]), tuple(float(x) for x in enc["assistant_masks"])))
  return out


def as_documents(batches, bos_id):
  return [(tuple(t.tolist()), tuple(m.tolist())) for t, m in ct.reconstruct_by_bos(batches,
                                                                                bos_id)]


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_processes_see_disjoint_shards_that_cover_every_record(tmp_path, llama_dir, fmt):
  source, chats = chat_source(tmp_path, fmt)
  expected = expected_documents(llama_dir, chats)
  bos = data.make_tokenizer(f"hf:{llama_dir}").bos_id
  for make in ("train", "eval"):
    cfg = data_config(source=source, tokenizer=f"hf:{llama_dir}", validation_fraction=0.0,
                      eval_source=source if make == "eval" else "", num_epochs=1,
                      shuffle_buffer=0)
    seen = []
    for index in range(2):
      kwargs = dict(global_batch_size=4, seq_len=48, process_index=index, process_count=2)
      it = (data.make_train_iterator(cfg, seed=3, **kwargs) if make == "train"
            else data.make_eval_iterator(cfg, **kwargs))
      seen.append(as_documents(list(it), bos))
    assert not set(seen[0]) & set(seen[1]), make
    assert sorted(seen[0] + seen[1]) == sorted(expected), make
    if make == "eval":  # unshuffled: process i reads records i, i + 2, ...
      assert seen[1] == expected[1::2]


def take(iterator, count):
  return [next(iterator) for _ in range(count)]


def assert_same_batches(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    for key in data.BATCH_KEYS:
      np.testing.assert_array_equal(g[key], w[key], err_msg=key)


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_restore_mid_epoch_gives_the_same_next_batches(tmp_path, llama_dir, fmt):
  source, _ = chat_source(tmp_path, fmt)
  cfg = data_config(source=source, tokenizer=f"hf:{llama_dir}", validation_fraction=0.0,
                    num_epochs=3, shuffle_buffer=8)
  args = dict(global_batch_size=2, seq_len=40, seed=5, process_index=1, process_count=2)
  reference = list(data.make_train_iterator(cfg, **args))
  assert any((b["loss_mask_BxL"] == 0).any() & (b["segment_ids_BxL"] > 0).any()
             for b in reference)  # the masks that must come back are not all ones
  for consumed in (1, 6, len(reference) // 2 + 1):
    it = data.make_train_iterator(cfg, **args)
    take(it, consumed)
    state = data.iterator_state_json(it)
    fresh = data.make_train_iterator(cfg, **args)
    data.restore_iterator_state(fresh, state)
    assert_same_batches(list(fresh), reference[consumed:])


def test_resume_in_a_fresh_process_and_worker_processes(tmp_path, llama_dir):
  import orbax.checkpoint as ocp
  source, _ = chat_source(tmp_path, "parquet")
  data_fields = {"source": source, "tokenizer": f"hf:{llama_dir}", "validation_fraction": 0.0,
                 "shuffle_buffer": 8, "seed": 2}
  iterator_args = {"global_batch_size": 2, "seq_len": 40, "seed": 0, "process_index": 0,
                   "process_count": 1}
  consumed, count = 9, 4
  it = data.make_train_iterator(data_config(**data_fields), **iterator_args)
  take(it, consumed)
  checkpoint_dir = str(tmp_path / "ckpt")
  with ocp.CheckpointManager(checkpoint_dir) as manager:
    manager.save(consumed, args=ocp.args.Composite(data=orbax_save_args(it)))
    manager.wait_until_finished()
  save_iterator_state(it, str(tmp_path / "state.json"))
  expected = take(it, count)
  spec = {"data": data_fields, "iterator": iterator_args, "count": count, "step": consumed,
          "checkpoint_dir": checkpoint_dir, "state_json": str(tmp_path / "state.json"),
          "out": str(tmp_path / "next")}
  subprocess.run([sys.executable, "-m", "tests.data.resume_worker", json.dumps(spec)],
                 check=True, timeout=600, cwd=ROOT)
  for suffix in ("orbax", "json"):
    with np.load(str(tmp_path / f"next_{suffix}.npz")) as f:
      got = [{k: f[f"{i}/{k}"] for k in data.BATCH_KEYS} for i in range(count)]
    assert_same_batches(got, expected)
  # A grain worker process gets a copy of the Parquet reader and the chat template.
  in_process = take(data.make_train_iterator(data_config(**data_fields), **iterator_args), 6)
  workers = data.make_train_iterator(data_config(worker_count=1, **data_fields), **iterator_args)
  try:
    assert_same_batches(take(workers, 6), in_process)
  finally:
    workers.close()
