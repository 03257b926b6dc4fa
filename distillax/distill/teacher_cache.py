"""The offline teacher cache: the teacher run once, its top-k per position kept on disk.

Its format, writer and reader; training from it is training_from_cache.py.

`write_teacher_cache` runs the teacher over batches and writes ArrayRecord files, one record per
batch row: the row's own batch arrays (inputs, targets, segments, positions, loss mask) plus
  teacher_topk_ids_BxLxK       int32   the teacher's k most likely tokens, most likely first
  teacher_topk_logprobs_BxLxK  float32 their log softmax(teacher_logits / T)
  teacher_nll_BxL              float32 the teacher's NLL of the target at T = 1 (teacher_ce)
Each record is an .npz archive of plain numeric arrays written with allow_pickle=False and read
back with allow_pickle=False: no pickle anywhere. `cache_info.json` beside the files records k,
T, the vocabulary size and the files.

`read_teacher_cache` gives a grain MapDataset over those records, batched like the input
(same rows, same order), for `CachedLogitKD` (logit_kd.py), which rebuilds the same top-k
buckets as the online LogitKD(top_k=k) and needs no teacher in memory. The cache is built for one
temperature: log-probs at T cannot be re-tempered without the full vocabulary.

Writing runs in one process (it fetches every batch's results to the host).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from typing import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax.data import batch as batch_spec
from distillax.distill.logit_kd import TEACHER_NLL, TOPK_IDS, TOPK_LOGPROBS
from distillax.errors import ConfigError, UserError
from distillax.framework import losses

CACHE_INFO = "cache_info.json"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class CacheInfo:
  top_k: int
  temperature: float
  vocab_size: int
  rows: int
  files: tuple[str, ...]  # relative to the cache directory
  keys: tuple[str, ...]  # the arrays of every record
  format_version: int = FORMAT_VERSION

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


def _teacher_topk_fn(teacher: nnx.Module, top_k: int, temperature: float):
  graphdef, state = nnx.split(teacher)

  @jax.jit
  def run(state, batch):
    model = nnx.merge(graphdef, state)
    out = model(batch[batch_spec.INPUTS], **losses.model_inputs(batch))
    logits = out.logits_BxLxV.astype(jnp.float32)
    logp_T = jax.nn.log_softmax(logits / temperature, axis=-1)
    top_logp, top_ids = jax.lax.top_k(logp_T, top_k)
    nll = losses.token_nll(logits, batch[batch_spec.TARGETS])
    return {TOPK_IDS: top_ids.astype(jnp.int32), TOPK_LOGPROBS: top_logp, TEACHER_NLL: nll}

  return lambda batch: run(state, batch)


def write_teacher_cache(teacher: nnx.Module, batches: Iterable[Mapping[str, np.ndarray]],
                        directory: str, *, top_k: int, temperature: float = 2.0,
                        rows_per_file: int = 4096) -> CacheInfo:
  """Runs `teacher` over `batches` (host numpy dicts with the framework's batch keys) and writes
  the cache to `directory` (created; must not already hold a cache)."""
  from array_record.python.array_record_module import ArrayRecordWriter

  vocab = teacher.config.vocab_size
  if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 < top_k <= vocab:
    raise ConfigError(f"teacher cache top_k={top_k!r} must be an integer in 1..{vocab} "
                      f"(the teacher vocabulary)")
  if not temperature > 0:
    raise ConfigError(f"teacher cache temperature={temperature!r} must be > 0")
  if rows_per_file <= 0:
    raise ConfigError(f"teacher cache rows_per_file={rows_per_file!r} must be positive")
  os.makedirs(directory, exist_ok=True)
  if os.path.exists(os.path.join(directory, CACHE_INFO)):
    raise UserError(f"{directory} already holds a teacher cache ({CACHE_INFO}); pick a new "
                    f"directory or delete the old cache")
  run = _teacher_topk_fn(teacher, top_k, float(temperature))
  files, writer, rows, in_file, keys = [], None, 0, 0, None
  try:
    for batch in batches:
      host = {k: np.asarray(v) for k, v in batch.items()}
      teacher_out = jax.device_get(run({k: jnp.asarray(v) for k, v in host.items()}))
      record_arrays = {**host, **{k: np.asarray(v) for k, v in teacher_out.items()}}
      keys = keys or tuple(sorted(record_arrays))
      for i in range(host[batch_spec.INPUTS].shape[0]):
        if writer is None or in_file == rows_per_file:
          if writer is not None:
            writer.close()
          files.append(f"teacher_cache-{len(files):05d}.array_record")
          writer = ArrayRecordWriter(os.path.join(directory, files[-1]), "group_size:1")
          in_file = 0
        writer.write(encode_row({k: v[i] for k, v in record_arrays.items()}))
        in_file, rows = in_file + 1, rows + 1
  finally:
    if writer is not None:
      writer.close()
  if rows == 0:
    raise UserError("write_teacher_cache got no batches; check the dataset feeding it")
  info = CacheInfo(top_k=top_k, temperature=float(temperature), vocab_size=vocab, rows=rows,
                   files=tuple(files), keys=keys)
  with open(os.path.join(directory, CACHE_INFO), "w") as f:
    f.write(info.to_json())
  return info


def read_cache_info(directory: str) -> CacheInfo:
  path = os.path.join(directory, CACHE_INFO)
  try:
    with open(path) as f:
      raw = json.load(f)
  except FileNotFoundError:
    raise UserError(f"{directory} is not a teacher cache (no {CACHE_INFO}); write one with "
                    f"distill.teacher_cache.write_teacher_cache") from None
  if raw.get("format_version") != FORMAT_VERSION:
    raise UserError(f"{path}: cache format {raw.get('format_version')!r}, this distillax reads "
                    f"{FORMAT_VERSION}; rebuild the cache")
  return CacheInfo(**{**raw, "files": tuple(raw["files"]), "keys": tuple(raw["keys"])})


def read_teacher_cache(directory: str, batch_size: int | None = None, *,
                       temperature: float | None = None, drop_remainder: bool = True):
  """A grain MapDataset of cached rows (batch_size None) or batches, in the order written.

  temperature: when given, must equal the cache's (the temperature CachedLogitKD uses).
  Shuffle, repeat, shard (`[i::n]`) and `.to_iter_dataset()` it like any grain MapDataset.
  """
  import grain

  info = read_cache_info(directory)
  if temperature is not None and abs(float(temperature) - info.temperature) > 1e-9:
    raise ConfigError(f"distillation temperature {temperature} differs from the teacher cache's "
                      f"{info.temperature} ({directory}); use T={info.temperature} or rebuild the "
                      f"cache at T={temperature}")
  source = grain.sources.ArrayRecordDataSource([os.path.join(directory, f) for f in info.files])
  dataset = grain.MapDataset.source(source).map(decode_row)
  if batch_size is not None:
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
  return dataset
