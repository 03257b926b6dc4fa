"""The config-driven builders: process sharding, epochs, determinism, eval, workers, errors."""

import os

import numpy as np
import pytest

from tests.data.data_testing import (byte_ids, check_row_invariants, data_config,
                                     reconstruct_documents)
from distillax import data
from distillax.errors import ConfigError, UserError


def train_documents(cfg, process_index, process_count, global_batch=4, seq_len=16, seed=0):
  it = data.make_train_iterator(cfg, global_batch_size=global_batch, seq_len=seq_len, seed=seed,
                                process_index=process_index, process_count=process_count)
  batches = list(it)
  for b in batches:
    assert b["inputs_BxL"].shape == (global_batch // process_count, seq_len)
    check_row_invariants(b)
  return reconstruct_documents(batches, eos_id=1)


def as_texts(docs):
  return [data.ByteTokenizer().decode(d) for d in docs]


def test_processes_see_disjoint_shards_that_cover_everything(corpus):
  folder, texts = corpus
  cfg = data_config(source=folder, validation_fraction=0.0, num_epochs=1, shuffle_buffer=0)
  seen = [as_texts(train_documents(cfg, i, 2)) for i in range(2)]
  assert not set(seen[0]) & set(seen[1])
  assert sorted(seen[0] + seen[1]) == sorted(t for t in texts if t)
  # Same for eval, on the hash split: the two processes together read the validation split.
  cfg = data_config(source=folder, validation_fraction=0.3)
  validation = data.split_documents(data.resolve_data_config(cfg), "eval")
  evals = [as_texts(reconstruct_documents(
      list(data.make_eval_iterator(cfg, global_batch_size=2, seq_len=8, process_index=i,
                                   process_count=2)), eos_id=1)) for i in range(2)]
  assert not set(evals[0]) & set(evals[1])
  assert sorted(evals[0] + evals[1]) == sorted(t for t in map(validation.__getitem__,
                                                              range(len(validation))) if t)


def test_epochs_reshuffle_documents(corpus):
  folder, texts = corpus
  cfg = data_config(source=folder, validation_fraction=0.0, num_epochs=2, shuffle_buffer=0)
  docs = as_texts(train_documents(cfg, 0, 1, seed=1))
  non_empty = [t for t in texts if t]
  first, second = docs[:len(non_empty)], docs[len(non_empty):]
  assert sorted(first) == sorted(second) == sorted(non_empty)
  assert first != second and first != non_empty
  assert as_texts(train_documents(cfg, 0, 1, seed=1)) == docs  # deterministic
  assert as_texts(train_documents(cfg, 0, 1, seed=2)) != docs
  # data.seed overrides the run seed.
  cfg.seed = 1
  assert as_texts(train_documents(cfg, 0, 1, seed=99)) == docs


def test_default_stdlib_train_and_eval_read_their_own_split():
  cfg = data.default_data_config()
  assert cfg.source == "stdlib" and cfg.tokenizer == "byte" and cfg.num_epochs is None
  resolved = data.resolve_data_config(cfg)
  val_texts = [d for d in map(data.split_documents(resolved, "eval").__getitem__,
                              range(len(data.split_documents(resolved, "eval"))))]
  tok = data.ByteTokenizer()
  ev = data.make_eval_iterator(cfg, global_batch_size=2, seq_len=512, process_index=0,
                               process_count=1, num_batches=3)
  train = data.make_train_iterator(cfg, global_batch_size=2, seq_len=512, seed=0,
                                   process_index=0, process_count=1)
  for split_texts, other_texts, it in ((val_texts, None, ev), (None, val_texts, train)):
    for b in [next(it) for _ in range(3)]:
      check_row_invariants(b)
      assert b["loss_mask_BxL"].all()  # long files: rows are full
      for row in range(2):
        seg = b["segment_ids_BxL"][row]
        piece = tok.decode(b["inputs_BxL"][row][seg == seg.max()])[:200]
        if split_texts is not None:
          assert any(piece in t for t in split_texts)
        else:
          assert not any(piece in t for t in other_texts)


def test_eval_is_deterministic_and_num_batches_is_exact(corpus):
  folder, _ = corpus
  cfg = data_config(source=folder, validation_fraction=0.5)
  make = lambda **kw: list(data.make_eval_iterator(
      cfg, global_batch_size=2, seq_len=16, process_index=0, process_count=1, **kw))
  full, again = make(), make()
  assert len(full) == len(again) > 3
  for a, b in zip(full, again):
    np.testing.assert_array_equal(a["inputs_BxL"], b["inputs_BxL"])
  longer = make(num_batches=len(full) + 3)
  assert len(longer) == len(full) + 3
  np.testing.assert_array_equal(longer[len(full) - 1]["inputs_BxL"], full[-1]["inputs_BxL"])
  for b in longer[len(full):]:
    assert not b["loss_mask_BxL"].any() and not b["segment_ids_BxL"].any()
    assert b["inputs_BxL"].shape == (2, 16)
  assert len(make(num_batches=2)) == 2


def test_worker_process_gives_the_same_batches(corpus):
  folder, _ = corpus
  make = lambda workers: data.make_train_iterator(
      data_config(source=folder, validation_fraction=0.0, shuffle_buffer=16,
                  worker_count=workers), global_batch_size=2, seq_len=16, seed=0,
      process_index=0, process_count=1)
  in_process = [b for b, _ in zip(make(0), range(30))]
  it = make(1)
  try:
    with_worker = [next(it) for _ in range(30)]
  finally:
    it.close()
  for a, b in zip(in_process, with_worker):
    for key in data.BATCH_KEYS:
      np.testing.assert_array_equal(a[key], b[key])


def test_config_errors(corpus):
  folder, _ = corpus
  cfg = data_config(source=folder)
  kwargs = dict(seq_len=16, seed=0, process_index=0)
  with pytest.raises(ConfigError, match="global_batch_size=6 cannot be split evenly over 4 JAX "
                                        "processes; it must be a multiple of 4"):
    data.make_train_iterator(cfg, global_batch_size=6, process_count=4, **kwargs)
  with pytest.raises(ConfigError, match="data.shufle_buffer is not a data config field"):
    data.make_train_iterator({"shufle_buffer": 3}, global_batch_size=4, process_count=1, **kwargs)
  with pytest.raises(ConfigError, match="process_index=2 is outside"):
    data.make_train_iterator(cfg, global_batch_size=4, seq_len=16, seed=0, process_index=2,
                             process_count=2)
  with pytest.raises(UserError, match=r"data.validation_fraction=0.0 holds out none of the "
                                     r"\d+ documents"):
    data.make_eval_iterator(data_config(source=folder, validation_fraction=0.0),
                            global_batch_size=2, seq_len=16, process_index=0, process_count=1)
  with pytest.raises(UserError, match="fewer than the 64 processes"):
    data.make_train_iterator(cfg, global_batch_size=64, process_count=64, **kwargs)
  missing = os.path.join(folder, "missing", "*.jsonl")
  with pytest.raises(UserError, match="matched no files"):
    data.make_train_iterator(data_config(source=missing), global_batch_size=4, process_count=1,
                             **kwargs)


def test_defaults_to_the_jax_process(corpus):
  folder, texts = corpus
  import jax
  assert (jax.process_index(), jax.process_count()) == (0, 1)
  cfg = data_config(source=folder, eval_source=folder)
  batches = list(data.make_eval_iterator(cfg, global_batch_size=3, seq_len=16))
  assert reconstruct_documents(batches, eos_id=1) == [byte_ids(t) for t in texts if t]


def test_default_config_documents_every_field():
  import inspect
  from distillax.data import pipeline
  source = inspect.getsource(pipeline.default_data_config)
  for field in data.default_data_config().keys():
    line_index = next(i for i, l in enumerate(source.splitlines()) if f"cfg.{field} =" in l)
    lines = source.splitlines()
    assert "#" in lines[line_index] or lines[line_index - 1].strip().startswith("#"), field
