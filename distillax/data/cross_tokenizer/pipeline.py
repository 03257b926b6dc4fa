"""Config -> grain iterators of cross-tokenizer rows (rows.py), as the packed
pipeline makes them (pipeline.py): the same document split, process sharding, shuffling and
eval batch count; the rows are one document window each instead of packed documents."""

from __future__ import annotations

import grain
import numpy as np

from distillax.data.cross_tokenizer import rows
from distillax.data import pipeline
from distillax.data.tokenizer import Tokenizer


def _batches(data_cfg, which: str, *, global_batch_size: int, seq_len: int,
             teacher_seq_len: int, student: Tokenizer, teacher: Tokenizer,
             teacher_to_student_Vt: np.ndarray, seed: int | None, process_index, process_count):
  cfg = pipeline.resolve_data_config(data_cfg)
  rows.check_text_layout(str(cfg.layout))
  process_index, process_count = pipeline._process(process_index, process_count)
  batch_size = pipeline.per_process_batch_size(global_batch_size, process_count)
  documents = pipeline.split_documents(cfg, which)
  ds = pipeline._document_shard(documents, process_index, process_count)
  if seed is not None:
    data_seed = int(seed if cfg.seed is None else cfg.seed)
    ds = ds.shuffle(seed=data_seed).repeat(cfg.num_epochs)
  cut = rows.CrossTokenizeDocument(student, teacher, teacher_to_student_Vt, seq_len,
                                   teacher_seq_len, cfg.add_bos)
  per_document = ds.map(cut).to_iter_dataset(
      grain.ReadOptions(num_threads=int(cfg.read_threads), prefetch_buffer_size=16))
  out = rows.RowsIterDataset(per_document)
  if seed is not None and cfg.shuffle_buffer > 1:
    out = grain.experimental.WindowShuffleIterDataset(out, window_size=int(cfg.shuffle_buffer),
                                                      seed=data_seed)
  stack = rows.StackCrossRows(batch_size, seq_len, teacher_seq_len, student.pad_id,
                              teacher.pad_id)
  return out.batch(batch_size, batch_fn=stack), stack


def make_cross_tokenizer_train_iterator(data_cfg, *, seed: int, **kwargs):
  """Endless (or `num_epochs`) shuffled iterator of this process's rows of each global batch.
  kwargs: global_batch_size, seq_len, teacher_seq_len, student, teacher (tokenizers),
  teacher_to_student_Vt (data.token_bytes.shared_vocab), process_index, process_count."""
  kwargs.setdefault("process_index", None)
  kwargs.setdefault("process_count", None)
  batches, _ = _batches(data_cfg, "train", seed=seed, **kwargs)
  return iter(batches)


def make_cross_tokenizer_eval_iterator(data_cfg, *, num_batches: int, **kwargs):
  """One unshuffled pass over the eval documents, exactly `num_batches` batches (cut short or
  extended with empty ones), as pipeline.make_eval_iterator."""
  kwargs.setdefault("process_index", None)
  kwargs.setdefault("process_count", None)
  batches, stack = _batches(data_cfg, "eval", seed=None, **kwargs)
  return iter(pipeline._ExactCountIterDataset(batches, count=int(num_batches),
                                              filler=rows.padding_batch(*stack.args)))
