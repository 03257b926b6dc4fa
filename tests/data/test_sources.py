"""Sources: each file format, paths and globs, the stdlib corpus and its deterministic split."""

import hashlib
import json
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from tests.data.data_testing import (byte_ids, data_config, random_texts, reconstruct_documents,
                                     write_text_files)
from distillax.data import load_documents, make_eval_iterator, stdlib_files, validation_mask
from distillax.errors import ConfigError, UserError


def read_all(docs):
  return [docs[i] for i in range(len(docs))]


def write_jsonl(path, texts, field="text"):
  with open(path, "w", encoding="utf-8") as f:
    for i, t in enumerate(texts):
      f.write(json.dumps({"id": i, field: t}) + "\n")
      if i == 2:
        f.write("\n")  # blank lines are not documents


def write_array_record(path, records):
  from array_record.python.array_record_module import ArrayRecordWriter
  writer = ArrayRecordWriter(path, "group_size:1")
  for r in records:
    writer.write(r)
  writer.close()


def test_text_directory_glob_and_single_file(corpus):
  folder, texts = corpus
  assert read_all(load_documents(folder)) == texts
  assert read_all(load_documents(os.path.join(folder, "f000*.txt"))) == texts[:10]
  assert read_all(load_documents(os.path.join(folder, "f0003.txt"))) == [texts[3]]
  assert load_documents(folder).all_keys()[:2] == ["f0000.txt", "f0001.txt"]


def test_jsonl(tmp_path):
  texts = random_texts(7, seed=1, min_len=1)
  write_jsonl(tmp_path / "a.jsonl", texts[:4])
  write_jsonl(tmp_path / "b.jsonl", texts[4:])
  docs = load_documents(str(tmp_path / "*.jsonl"))
  assert read_all(docs) == texts
  assert docs.all_keys()[:5] == ["a.jsonl:0", "a.jsonl:1", "a.jsonl:2", "a.jsonl:3", "b.jsonl:0"]
  # An explicit format overrides the extension.
  os.rename(tmp_path / "b.jsonl", tmp_path / "b.data")
  assert read_all(load_documents(str(tmp_path / "b.data"), "jsonl")) == texts[4:]


def test_jsonl_custom_field_and_missing_field(tmp_path):
  write_jsonl(tmp_path / "c.jsonl", ["x1", "y2"], field="content")
  assert read_all(load_documents(str(tmp_path / "c.jsonl"), text_field="content")) == ["x1", "y2"]
  docs = load_documents(str(tmp_path / "c.jsonl"))
  with pytest.raises(UserError, match=r"c\.jsonl: line 1 has no string field 'text'"):
    docs[0]
  # The same error surfaces from the grain pipeline, which reads documents on its threads.
  it = make_eval_iterator(data_config(source=str(tmp_path), eval_source=str(tmp_path)),
                          global_batch_size=1, seq_len=8, process_index=0, process_count=1)
  with pytest.raises(UserError, match="has no string field 'text'.*data.text_field"):
    next(it)


def test_array_record_text_and_json_records(tmp_path):
  texts = random_texts(6, seed=2, min_len=1)
  records = [t.encode() if i % 2 else json.dumps({"text": t}).encode() for i, t in enumerate(texts)]
  write_array_record(str(tmp_path / "part.array_record"), records)
  docs = load_documents(str(tmp_path / "part.array_record"))
  assert read_all(docs) == texts
  assert docs.all_keys()[-1] == "part.array_record:5"


def test_mixed_formats_through_the_pipeline(tmp_path):
  texts = random_texts(9, seed=4, min_len=1)
  write_text_files(str(tmp_path / "d"), texts[:3])
  write_jsonl(str(tmp_path / "d" / "g.jsonl"), texts[3:6])
  write_array_record(str(tmp_path / "d" / "h.array_record"), [t.encode() for t in texts[6:]])
  cfg = data_config(source=str(tmp_path / "d"), eval_source=str(tmp_path / "d"))
  batches = list(make_eval_iterator(cfg, global_batch_size=2, seq_len=32, process_index=0,
                                    process_count=1))
  docs = reconstruct_documents(batches, eos_id=1)
  # Text files first (sorted), then the other files in path order.
  assert docs == [byte_ids(t) for t in texts]


def test_missing_path_and_empty_glob_name_the_path(tmp_path):
  missing = str(tmp_path / "nope" / "data.jsonl")
  with pytest.raises(UserError, match="no such file or directory") as e:
    load_documents(missing)
  assert missing in str(e.value)
  pattern = str(tmp_path / "*.jsonl")
  with pytest.raises(UserError, match="matched no files") as e:
    load_documents(pattern)
  assert pattern in str(e.value)
  with pytest.raises(ConfigError, match="data.format='csv' is not one of .*parquet"):
    load_documents(str(tmp_path), "csv")


def test_stdlib_corpus_is_the_interpreters_own_source():
  root, files = stdlib_files()
  assert root == sysconfig.get_paths()["stdlib"]
  rel = [os.path.relpath(f, root).split(os.sep) for f in files]
  assert all(f.endswith(".py") for f in files)
  assert not any({"site-packages", "test", "tests", "__pycache__"} & set(parts) for parts in rel)
  names = {"/".join(parts) for parts in rel}
  assert {"os.py", "json/decoder.py", "collections/__init__.py"} <= names
  with open(os.path.join(root, "os.py"), encoding="utf-8") as f:
    os_source = f.read()
  docs = load_documents("stdlib")
  assert docs[docs.all_keys().index("os.py")] == os_source


def test_split_is_disjoint_complete_and_by_path_hash():
  docs = load_documents("stdlib")
  train, validation = docs.split(0.05)
  train_keys, val_keys = set(train.all_keys()), set(validation.all_keys())
  assert not train_keys & val_keys and train_keys | val_keys == set(docs.all_keys())
  assert 0.02 < len(val_keys) / len(docs) < 0.1
  # The split is SHA-256 of the path relative to the stdlib, first 8 bytes vs fraction * 2^64.
  for key in list(val_keys)[:5] + list(train_keys)[:5]:
    h = int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) / 2.0**64
    assert (h < 0.05) == (key in val_keys)


def test_split_does_not_depend_on_order_or_process():
  keys = [f"pkg{i % 7}/mod{i}.py" for i in range(400)]
  mask = validation_mask(keys, 0.1)
  np.testing.assert_array_equal(validation_mask(keys[::-1], 0.1)[::-1], mask)
  code = ("import json,sys; from distillax.data import load_documents;"
          "t,v=load_documents('stdlib').split(0.05); print(json.dumps(v.all_keys()))")
  env = dict(os.environ, PYTHONHASHSEED="12345")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True, timeout=600).stdout
  assert json.loads(out) == load_documents("stdlib").split(0.05)[1].all_keys()
  with pytest.raises(ConfigError, match="validation_fraction"):
    validation_mask(keys, 1.5)
