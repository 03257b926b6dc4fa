"""Config -> grain iterators of packed, process-local batches (train: shuffled; eval: fixed).

Pipeline per process: documents[process_index::process_count] -> (train) global document shuffle,
reshuffled every epoch -> repeat -> tokenize lazily, one document at a time, on `read_threads`
threads (chat and prompt/completion records: rendered and masked, chat.py) -> pack into rows
(the per-token train mask becomes the rows' loss mask) -> (train) shuffle rows within windows of
`shuffle_buffer` -> batch (global batch / process count rows; a short final batch of a finite
pass is padded) -> (train, optional) `worker_count` grain worker processes.
"""

from __future__ import annotations

import grain
import ml_collections
import numpy as np
from ml_collections import config_dict

from distillax.data import chat, records, sources
from distillax.data.batch import check_batch_size
from distillax.data.batch import padding_rows
from distillax.data.packing import PackedIterDataset, StackRows
from distillax.data.tokenizer import Tokenizer, make_tokenizer
from distillax.errors import ConfigError, UserError


def default_data_config() -> ml_collections.ConfigDict:
  """The `data` section of a job config, every field with its default."""
  cfg = ml_collections.ConfigDict()
  # 'stdlib' (this interpreter's standard-library .py files: no download) or a file, dir or glob.
  cfg.source = "stdlib"
  # 'auto' (per file: .jsonl/.json/.ndjson -> jsonl, .parquet/.pq -> parquet, *array_record* ->
  # arrayrecord, else text), 'text' (a file is a document), 'jsonl' (a line is a document),
  # 'parquet' (a row is) or 'arrayrecord' (a record is).
  cfg.format = "auto"
  # How a JSONL line / Parquet row / JSON ArrayRecord holds its document, as Hugging Face data
  # sets lay them out: 'auto' (per record: a `messages_field` list, else 'prompt'+'completion',
  # else `text_field`), 'text', 'messages' (chat turns) or 'prompt_completion'.
  cfg.layout = "auto"
  cfg.text_field = "text"  # field with the document text (JSONL lines, Parquet rows, ...)
  cfg.messages_field = "messages"  # field with the chat turns: [{"role": ..., "content": ...}]
  # '' = render chat records with the tokenizer's own template (chat_template.jinja or
  # tokenizer_config.json beside tokenizer.json); else the path of a Jinja template file.
  cfg.chat_template = ""
  # Tokens of chat and prompt/completion records that the loss (CE and every distillation term)
  # covers: 'assistant' (assistant turns; the completion) or 'all'. Text records: every token.
  cfg.loss_on = "assistant"
  # '' = eval on the validation split of `source`; else a file/dir/glob evaluated whole (and
  # `source` is then trained on whole).
  cfg.eval_source = ""
  cfg.validation_fraction = 0.05  # share of documents held out for eval, by a hash of their path
  cfg.tokenizer = "byte"  # 'byte' | 'spm:<path to .model>' | 'hf:<path to tokenizer.json>'
  cfg.add_bos = True  # start each document with the tokenizer's BOS (if any); EOS always ends it
  cfg.shuffle_buffer = 1024  # train rows are shuffled within windows of this many rows (0 = off)
  cfg.seed = config_dict.placeholder(int)  # data shuffling seed; None = the run's seed
  cfg.num_epochs = config_dict.placeholder(int)  # passes over the train split; None = forever
  cfg.read_threads = 2  # threads reading and tokenizing documents ahead of packing
  # grain worker processes for the train pipeline (0 = in-process). Workers change the batch
  # order (still deterministic) and need parsed absl flags and a __main__ guard.
  cfg.worker_count = 0
  return cfg


def make_train_iterator(data_cfg, *, global_batch_size: int, seq_len: int, seed: int,
                        process_index: int | None = None, process_count: int | None = None,
                        tokenizer: Tokenizer | None = None) -> grain.DatasetIterator:
  """Endless (or `num_epochs`) shuffled iterator of this process's share of each global batch."""
  cfg = resolve_data_config(data_cfg)
  process_index, process_count = _process(process_index, process_count)
  batch_size = per_process_batch_size(global_batch_size, process_count)
  _check_positive("seq_len", seq_len)
  if cfg.num_epochs is not None and cfg.num_epochs < 1:
    raise ConfigError(f"data.num_epochs={cfg.num_epochs} must be >= 1, or None to repeat forever")
  _check_non_negative("data.shuffle_buffer", cfg.shuffle_buffer)
  _check_non_negative("data.worker_count", cfg.worker_count)
  documents = split_documents(cfg, "train")
  tokenizer = tokenizer if tokenizer is not None else make_tokenizer(cfg.tokenizer)
  data_seed = int(seed if cfg.seed is None else cfg.seed)
  ds = _document_shard(documents, process_index, process_count)
  ds = ds.shuffle(seed=data_seed).repeat(cfg.num_epochs)
  rows = _packed_rows(ds, tokenizer, cfg, seq_len)
  if cfg.shuffle_buffer > 1:
    rows = grain.experimental.WindowShuffleIterDataset(
        rows, window_size=int(cfg.shuffle_buffer), seed=data_seed)
  batches = rows.batch(batch_size, batch_fn=StackRows(batch_size, seq_len, tokenizer.pad_id))
  if cfg.worker_count > 0:
    _mark_absl_flags_parsed()
    batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(cfg.worker_count)))
  return iter(batches)


def make_eval_iterator(data_cfg, *, global_batch_size: int, seq_len: int,
                       process_index: int | None = None, process_count: int | None = None,
                       num_batches: int | None = None,
                       tokenizer: Tokenizer | None = None) -> grain.DatasetIterator:
  """One unshuffled pass over the eval documents; the same batches on every call.

  With `num_batches`, exactly that many batches come out: the pass is cut short, or extended
  with all-padding batches (loss mask 0). Use it on multi-process runs, where the processes'
  shards pack into different numbers of rows but every process must run the same eval steps.
  """
  cfg = resolve_data_config(data_cfg)
  process_index, process_count = _process(process_index, process_count)
  batch_size = per_process_batch_size(global_batch_size, process_count)
  _check_positive("seq_len", seq_len)
  documents = split_documents(cfg, "eval")
  tokenizer = tokenizer if tokenizer is not None else make_tokenizer(cfg.tokenizer)
  ds = _document_shard(documents, process_index, process_count)
  rows = _packed_rows(ds, tokenizer, cfg, seq_len)
  batches = rows.batch(batch_size, batch_fn=StackRows(batch_size, seq_len, tokenizer.pad_id))
  if num_batches is not None:
    _check_positive("num_batches", num_batches)
    batches = _ExactCountIterDataset(
        batches, count=int(num_batches), filler=padding_rows(batch_size, seq_len, tokenizer.pad_id))
  return iter(batches)


def resolve_data_config(data_cfg) -> ml_collections.ConfigDict:
  """The defaults overlaid with `data_cfg` (a ConfigDict or dict); unknown fields are an error."""
  cfg = default_data_config()
  given = {} if data_cfg is None else dict(data_cfg.items())
  for key, value in given.items():
    if key not in cfg:
      raise ConfigError(f"data.{key} is not a data config field; known fields: "
                        f"{', '.join(sorted(cfg.keys()))}")
    try:
      cfg[key] = value
    except TypeError as e:
      raise ConfigError(f"data.{key}={value!r} has the wrong type ({e})") from e
  return cfg


def per_process_batch_size(global_batch_size: int, process_count: int) -> int:
  return check_batch_size(global_batch_size, process_count=process_count,
                          field="global_batch_size")


def split_documents(cfg, which: str) -> sources.Documents:
  """The train or eval documents named by the config."""
  layout = records.RecordLayout.from_config(cfg)
  if cfg.eval_source:
    spec = cfg.source if which == "train" else cfg.eval_source
    documents = sources.load_documents(spec, cfg.format, cfg.text_field, layout)
  else:
    train, validation = sources.load_documents(
        cfg.source, cfg.format, cfg.text_field, layout).split(cfg.validation_fraction)
    documents = train if which == "train" else validation
    if len(documents) == 0 and len(train) + len(validation):
      # The split is by a hash of each document: a small fraction of few documents holds out none.
      what, fix = (("holds out none", "raise it") if which == "eval" else
                   ("leaves none to train on", "lower it or add documents"))
      raise UserError(f"data.validation_fraction={cfg.validation_fraction} {what} of the "
                      f"{len(train) + len(validation)} documents of data source {cfg.source!r} "
                      f"(each goes to eval by a hash of it); {fix}, or set data.eval_source")
  if len(documents) == 0:
    hint = ("raise data.validation_fraction or set data.eval_source" if which == "eval"
            else "lower data.validation_fraction or add documents")
    raise UserError(f"the {which} documents of data source {documents.name!r} are empty; {hint}")
  return documents


class TokenizeDocument(grain.transforms.Map):
  """text -> int32 tokens: [BOS] + encode(text) + [EOS]; an empty text gives no tokens.

  Chat and prompt/completion records -> (int32 tokens, float32 per-token train mask), see
  chat.py; one with no trained token after its first gives no tokens (nothing to learn)."""

  def __init__(self, tokenizer: Tokenizer, add_bos: bool,
               template: chat.ChatTemplate | None = None, loss_on: str = "assistant"):
    self.tokenizer = tokenizer
    self.add_bos = bool(add_bos)
    self.template = template
    self.loss_on = chat.check_loss_on(loss_on)

  def map(self, document):
    if isinstance(document, str):
      return self._text(document)
    if isinstance(document, records.ChatRecord):
      tokens, mask = chat.encode_chat(document, self.tokenizer, self.template, self.loss_on)
    else:
      tokens, mask = chat.encode_prompt_completion(document, self.tokenizer, self.add_bos,
                                                   self.loss_on)
    if not mask[1:].any():
      return np.zeros(0, np.int32)
    return tokens, mask

  def _text(self, text: str) -> np.ndarray:
    tokens = self.tokenizer.encode_array(text)
    if tokens.size == 0:
      return tokens.astype(np.int32)
    head = [self.tokenizer.bos_id] if self.add_bos and self.tokenizer.bos_id is not None else []
    tail = [self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else []
    return np.concatenate([np.asarray(head, np.int32), tokens.astype(np.int32),
                           np.asarray(tail, np.int32)])


def _packed_rows(ds: grain.MapDataset, tokenizer: Tokenizer, cfg,
                 seq_len: int) -> grain.IterDataset:
  _check_positive("data.read_threads", cfg.read_threads)
  template = chat.template_for(tokenizer, cfg.chat_template)
  if template is None and cfg.layout == "messages":
    raise UserError(f"data.layout='messages' renders chats with a chat template, but "
                    f"{tokenizer!r} has none; use a tokenizer whose folder has one "
                    f"(chat_template.jinja, tokenizer_config.json) or set data.chat_template")
  tokenize = TokenizeDocument(tokenizer, cfg.add_bos, template, cfg.loss_on)
  tokens = ds.map(tokenize).to_iter_dataset(
      grain.ReadOptions(num_threads=int(cfg.read_threads), prefetch_buffer_size=16))
  return PackedIterDataset(tokens, seq_len=seq_len, pad_id=tokenizer.pad_id)


def _document_shard(documents: sources.Documents, process_index: int,
                    process_count: int) -> grain.MapDataset:
  check_shardable(documents, process_count)
  return grain.MapDataset.source(documents)[process_index::process_count]


def check_shardable(documents: sources.Documents, process_count: int) -> None:
  if len(documents) < process_count:
    raise UserError(
        f"data source {documents.name!r} has {len(documents)} documents, fewer than the "
        f"{process_count} processes that each need a share; add documents")


def _process(process_index, process_count) -> tuple[int, int]:
  if process_index is None or process_count is None:
    import jax
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ConfigError(f"process_index={process_index} is outside [0, {process_count})")
  return int(process_index), int(process_count)


def _check_positive(name, value):
  if int(value) < 1:
    raise ConfigError(f"{name}={value} must be a positive integer")


def _check_non_negative(name, value):
  if int(value) < 0:
    raise ConfigError(f"{name}={value} must be >= 0")


def _mark_absl_flags_parsed():
  """grain workers read absl flags; outside absl.app.run they are unparsed and reading fails."""
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


class _ExactCountIterDataset(grain.IterDataset):
  """Yields exactly `count` elements: the parent's, then copies of `filler`."""

  def __init__(self, parent: grain.IterDataset, *, count: int, filler):
    super().__init__(parent)
    self._count, self._filler = count, filler

  def __iter__(self):
    return _ExactCountIterator(self._parent.__iter__(), count=self._count, filler=self._filler)


class _ExactCountIterator(grain.DatasetIterator):

  def __init__(self, parent, *, count, filler):
    super().__init__(parent)
    self._count, self._filler, self._emitted = count, filler, 0
    self._parent_done = False

  def __next__(self):
    if self._emitted >= self._count:
      raise StopIteration
    element = None
    if not self._parent_done:
      try:
        element = next(self._parent)
      except StopIteration:
        self._parent_done = True
    if element is None:
      element = {k: v.copy() for k, v in self._filler.items()}
    self._emitted += 1
    return element

  def get_state(self):
    return {"parent": self._parent.get_state(), "emitted": self._emitted,
            "parent_done": self._parent_done}

  def set_state(self, state):
    self._parent.set_state(state["parent"])
    self._emitted, self._parent_done = int(state["emitted"]), bool(state["parent_done"])
