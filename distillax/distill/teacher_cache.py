"""The offline teacher cache: the teacher run once, its outputs per position kept on disk.

Its format, writer and reader; training from it is training_from_cache.py.

`write_teacher_cache` runs the teacher over batches and writes ArrayRecord files, one record per
batch row: the row's own batch arrays (inputs, targets, segments, positions, loss mask) plus,
for kind 'topk' (the default),
  teacher_topk_ids_BxLxK       int32   the teacher's k most likely tokens, most likely first
  teacher_topk_logprobs_BxLxK  float32 their log softmax(teacher_logits / T)
  teacher_nll_BxL              float32 the teacher's NLL of the target at T = 1 (teacher_ce)
or, for kind 'hidden',
  teacher_hidden_BxLxD  bfloat16 | float32  the teacher's final hidden states (after the final
                                            norm); bfloat16 is stored as its uint16 bits
with the teacher's output layer saved once beside the files (teacher_head.py: HEAD_FILE, its
fingerprint in cache_info.json). Each record is an .npz archive of plain numeric arrays written
with allow_pickle=False and read back with allow_pickle=False: no pickle anywhere.
`cache_info.json` beside the files records the kind, k, T, the vocabulary size and the files.

`read_teacher_cache` gives a grain MapDataset over those records, batched like the input
(same rows, same order). A top-k cache serves `CachedLogitKD` (logit_kd.py), which rebuilds the
same top-k buckets as the online LogitKD(top_k=k), at the one temperature it was written for. A
hidden-state cache gives the exact full-vocabulary teacher logits back (head x hidden states,
chunk by chunk in the vocabulary-chunk engine), so every logit strategy at any temperature works
from it.

Several processes write one cache: each runs the teacher on the global batch and writes the rows
of its own data shard to its own files (`teacher_cache-<process>-<n>.array_record`, listed in
`cache_shard-<process>.json`); process 0 then joins the lists into cache_info.json. The reader
interleaves the shards back into the global batches' order, so a cache written by N processes
reads the same on any number.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
from typing import Callable, Iterable, Mapping

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax.data import batch as batch_spec
from distillax.distill.logit_kd import TEACHER_NLL, TOPK_IDS, TOPK_LOGPROBS
from distillax.distill.teacher_head import TEACHER_HIDDEN, head_of, save_head
from distillax.errors import ConfigError, UserError
from distillax.framework import losses, token_rows

CACHE_INFO = "cache_info.json"
SHARD_INFO = "cache_shard-{:05d}.json"  # one writing process's files and rows
FORMAT_VERSION = 1
KINDS = ("topk", "hidden")
HIDDEN_DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class CacheInfo:
  top_k: int  # 0 for a hidden-state cache
  temperature: float  # 0 for a hidden-state cache (any temperature works from it)
  vocab_size: int
  rows: int
  files: tuple[str, ...]  # relative to the cache directory
  keys: tuple[str, ...]  # the arrays of every record
  format_version: int = FORMAT_VERSION
  kind: str = "topk"  # 'topk' | 'hidden'
  hidden_dtype: str = ""  # hidden: the stored dtype of TEACHER_HIDDEN
  head_fingerprint: str = ""  # hidden: teacher_head.fingerprint of the saved head
  # Per writing process, (rows of each of its batches, rows written): the order of the shards.
  shards: tuple[tuple[int, int], ...] = ()

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1)


def encode_row(arrays: Mapping[str, np.ndarray]) -> bytes:
  """One record: an .npz of numeric arrays (object arrays are refused, never pickled)."""
  buf = io.BytesIO()
  np.savez(buf, allow_pickle=False, **{k: np.asarray(v) for k, v in arrays.items()})
  return buf.getvalue()


def decode_row(record: bytes) -> dict[str, np.ndarray]:
  with np.load(io.BytesIO(record), allow_pickle=False) as npz:
    return {k: npz[k] for k in npz.files}


def decode_hidden_row(record: bytes, hidden_dtype: str = "bfloat16") -> dict[str, np.ndarray]:
  """A hidden-state cache's row, its hidden states back in their dtype (npz has no bfloat16)."""
  row = decode_row(record)
  if hidden_dtype == "bfloat16":
    row[TEACHER_HIDDEN] = row[TEACHER_HIDDEN].view(jnp.bfloat16)
  return row


def _teacher_fn(teacher: nnx.Module, kind: str, top_k: int, temperature: float,
                hidden_dtype: str, rows: int | None = None):
  graphdef, state = nnx.split(teacher)

  @jax.jit
  def run(state, batch):
    model = nnx.merge(graphdef, state)
    if kind == "hidden":
      out = model(batch[batch_spec.INPUTS], **losses.model_inputs(batch), return_logits=False)
      hidden = out.final_hidden_BxLxD.astype(hidden_dtype)
      if hidden_dtype == "bfloat16":  # stored as its bits: npz has no bfloat16
        hidden = jax.lax.bitcast_convert_type(hidden, jnp.uint16)
      return {TEACHER_HIDDEN: hidden}
    out = model(batch[batch_spec.INPUTS], **losses.model_inputs(batch))
    # Over the tokenizer's ids, as the losses that read the cache take theirs
    # (framework/token_rows.py): a padded row is never one of the top k.
    logits = token_rows.masked(out.logits_BxLxV.astype(jnp.float32), rows)
    logp_T = jax.nn.log_softmax(logits / temperature, axis=-1)
    top_logp, top_ids = jax.lax.top_k(logp_T, top_k)
    nll = losses.token_nll(logits, batch[batch_spec.TARGETS])
    return {TOPK_IDS: top_ids.astype(jnp.int32), TOPK_LOGPROBS: top_logp, TEACHER_NLL: nll}

  return lambda batch: run(state, batch)


def _check_args(vocab: int, kind: str, top_k: int, temperature: float, hidden_dtype: str,
                rows_per_file: int) -> None:
  if kind not in KINDS:
    raise ConfigError(f"teacher cache kind={kind!r}; choose one of {', '.join(KINDS)}")
  if kind == "hidden":
    if hidden_dtype not in HIDDEN_DTYPES:
      raise ConfigError(f"teacher cache dtype={hidden_dtype!r}; choose one of "
                        f"{', '.join(HIDDEN_DTYPES)} (float32 for exact logits)")
  elif not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 < top_k <= vocab:
    raise ConfigError(f"teacher cache top_k={top_k!r} must be an integer in 1..{vocab} "
                      f"(the teacher vocabulary)")
  elif not temperature > 0:
    raise ConfigError(f"teacher cache temperature={temperature!r} must be > 0")
  if rows_per_file <= 0:
    raise ConfigError(f"teacher cache rows_per_file={rows_per_file!r} must be positive")


def write_teacher_cache(teacher: nnx.Module, batches: Iterable[Mapping[str, np.ndarray]],
                        directory: str, *, top_k: int = 0, temperature: float = 2.0,
                        rows_per_file: int = 4096, kind: str = "topk",
                        hidden_dtype: str = "bfloat16",
                        place: Callable | None = None, fetch: Callable | None = None,
                        vocab_limit: int | None = None) -> CacheInfo:
  """Runs `teacher` over `batches` (host numpy dicts with the framework's batch keys: this
  process's share of each global batch) and writes the cache to `directory` (created; must not
  already hold a cache). kind 'topk' keeps `top_k` log-probs at `temperature`; 'hidden' keeps
  the final hidden states in `hidden_dtype` and saves the teacher's head beside them.

  place: host batch -> the teacher's input (default: jnp arrays on this process's devices);
  fetch: a teacher output -> this process's rows as numpy (default: jax.device_get). With
  several processes every one calls this together (the teacher runs on the global batch).
  vocab_limit: the tokenizer's ids; the top k and the teacher's NLL are over them (a padded
  vocabulary's rows past them left out, as training's losses leave them out)."""
  vocab = teacher.config.vocab_size
  _check_args(vocab, kind, top_k, temperature, hidden_dtype, rows_per_file)
  os.makedirs(directory, exist_ok=True)
  if os.path.exists(os.path.join(directory, CACHE_INFO)):
    raise UserError(f"{directory} already holds a teacher cache ({CACHE_INFO}); pick a new "
                    f"directory or delete the old cache")
  place = place or (lambda batch: {k: jnp.asarray(v) for k, v in batch.items()})
  fetch = fetch or (lambda x: np.asarray(jax.device_get(x)))
  run = _teacher_fn(teacher, kind, top_k, float(temperature), hidden_dtype, vocab_limit)
  outputs = ({**host, **{k: fetch(v) for k, v in run(place(host)).items()}}
             for host in ({k: np.asarray(v) for k, v in b.items()} for b in batches))
  shard = _write_rows(outputs, directory, rows_per_file)
  head = head_of(teacher) if kind == "hidden" else None  # every process joins the gather
  _sync("teacher_cache_rows")
  if shard["rows"] == 0:
    raise UserError("write_teacher_cache got no batches; check the dataset feeding it")
  info = CacheInfo(top_k=top_k if kind == "topk" else 0,
                   temperature=float(temperature) if kind == "topk" else 0.0,
                   vocab_size=vocab, rows=0, files=(), keys=tuple(shard["keys"]), kind=kind,
                   hidden_dtype=hidden_dtype if kind == "hidden" else "")
  info = _joined(directory, info)
  if jax.process_index() == 0:
    if head is not None:
      info = dataclasses.replace(info, head_fingerprint=save_head(head, directory))
    with open(os.path.join(directory, CACHE_INFO), "w") as f:
      f.write(info.to_json())
  _sync("teacher_cache_info")
  return read_cache_info(directory) if jax.process_count() > 1 else info


def _write_rows(outputs, directory: str, rows_per_file: int) -> dict:
  """This process's rows into its own ArrayRecord files; returns its shard listing (also
  written as SHARD_INFO)."""
  from array_record.python.array_record_module import ArrayRecordWriter

  process = jax.process_index()
  files, writer, rows, in_file, keys, local_batch = [], None, 0, 0, None, 0
  try:
    for record_arrays in outputs:
      keys = keys or sorted(record_arrays)
      local_batch = local_batch or int(record_arrays[batch_spec.INPUTS].shape[0])
      for i in range(record_arrays[batch_spec.INPUTS].shape[0]):
        if writer is None or in_file == rows_per_file:
          if writer is not None:
            writer.close()
          files.append(f"teacher_cache-{process:05d}-{len(files):05d}.array_record")
          writer = ArrayRecordWriter(os.path.join(directory, files[-1]), "group_size:1")
          in_file = 0
        writer.write(encode_row({k: v[i] for k, v in record_arrays.items()}))
        in_file, rows = in_file + 1, rows + 1
  finally:
    if writer is not None:
      writer.close()
  shard = {"files": files, "rows": rows, "local_batch": local_batch, "keys": keys or []}
  with open(os.path.join(directory, SHARD_INFO.format(process)), "w") as f:
    json.dump(shard, f)
  return shard


def _joined(directory: str, info: CacheInfo) -> CacheInfo:
  """`info` with every writing process's files and rows, in process order."""
  files, shards = [], []
  for process in range(jax.process_count()):
    with open(os.path.join(directory, SHARD_INFO.format(process))) as f:
      shard = json.load(f)
    files += shard["files"]
    shards.append((int(shard["local_batch"]), int(shard["rows"])))
  return dataclasses.replace(info, rows=sum(r for _, r in shards), files=tuple(files),
                             shards=tuple(shards))


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def read_cache_info(directory: str) -> CacheInfo:
  path = os.path.join(directory, CACHE_INFO)
  if not os.path.isdir(directory):
    raise UserError(f"teacher.cache_dir={directory} does not exist; write the cache there "
                    f"with distillax cache-teacher, or fix the path")
  try:
    with open(path) as f:
      raw = json.load(f)
  except FileNotFoundError:
    raise UserError(f"{directory} is not a teacher cache (no {CACHE_INFO}); write one with "
                    f"distill.teacher_cache.write_teacher_cache") from None
  if raw.get("format_version") != FORMAT_VERSION:
    raise UserError(f"{path}: cache format {raw.get('format_version')!r}, this distillax reads "
                    f"{FORMAT_VERSION}; rebuild the cache")
  return CacheInfo(**{**raw, "files": tuple(raw["files"]), "keys": tuple(raw["keys"]),
                      "shards": tuple(tuple(s) for s in raw.get("shards", ()))})


def global_order(shards) -> np.ndarray | None:
  """Row index (in file order) of each row in the global batches' order: batch b is process 0's
  b-th local batch, then process 1's, ...; None when one process wrote the cache."""
  if len(shards) <= 1:
    return None
  starts = np.cumsum([0] + [rows for _, rows in shards])
  batches = min(rows // local for local, rows in shards)
  order = [np.arange(start + b * local, start + (b + 1) * local)
           for b in range(batches) for (local, _), start in zip(shards, starts)]
  return np.concatenate(order)


class _Ordered(grain.MapDataset):
  """`parent`'s rows in the order of the index array `order`."""

  def __init__(self, parent: grain.MapDataset, order: np.ndarray):
    super().__init__(parent)
    self._order = order

  def __len__(self) -> int:
    return len(self._order)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    return self._parent[int(self._order[index])]


def read_teacher_cache(directory: str, batch_size: int | None = None, *,
                       temperature: float | None = None, drop_remainder: bool = True):
  """A grain MapDataset of cached rows (batch_size None) or batches, in the global order.

  temperature: for a top-k cache, when given, must equal the cache's (the temperature
  CachedLogitKD uses); a hidden-state cache serves any. Shuffle, repeat, shard (`[i::n]`) and
  `.to_iter_dataset()` it like any grain MapDataset.
  """
  info = read_cache_info(directory)
  if (info.kind == "topk" and temperature is not None
      and abs(float(temperature) - info.temperature) > 1e-9):
    raise ConfigError(f"distillation temperature {temperature} differs from the teacher cache's "
                      f"{info.temperature} ({directory}); use T={info.temperature} or rebuild the "
                      f"cache at T={temperature}")
  source = grain.sources.ArrayRecordDataSource([os.path.join(directory, f) for f in info.files])
  dataset = grain.MapDataset.source(source)
  order = global_order(info.shards)
  if order is not None:
    dataset = _Ordered(dataset, order)
  if info.kind == "hidden":
    dataset = dataset.map(functools.partial(decode_hidden_row, hidden_dtype=info.hidden_dtype))
  else:
    dataset = dataset.map(decode_row)
  if batch_size is not None:
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
  return dataset
