"""The sources of a job's several teachers (the `teachers` list), read once, in list order.

Each entry is a teacher section (workdir / hf_path / preset, dtype overrides) plus its `name`
and `weight`; its source is named by the entry's index in error lines (`teachers[1].hf_path`).
Fresh preset teachers each draw from their own seed stream (PRESET_SEED_OFFSET + index), so two
entries of one preset are two different teachers. One entry may be a hidden-state teacher cache
(`cache_dir`, written by `distillax cache-teacher --kind hidden`): its source is the cache's LM
head (cache_head.py), its model config None; a workdir or hf_path named beside it is the teacher
the cache must come from (their head fingerprints are compared when the recipe loads it).
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from distillax.distill.teacher_cache import read_cache_info
from distillax.errors import ConfigError
from distillax.models.config import TransformerConfig
from distillax.trainers.paths import absolute
from distillax.trainers.sources.cache_head import CacheHeadSource
from distillax.trainers.sources.kinds import HFSource, ModelSource, RunSource, preset_source
from distillax.trainers.sources.select import (PRESET_SEED_OFFSET, student_source,
                                               teacher_model_config)


ENTRY_PATHS = ("workdir", "hf_path", "cache_dir")  # the path fields of a `teachers` entry


def absolute_teacher_paths(config):
  """`config` with its teachers (ConfigDicts) with their paths and routing sources absolute (from the current
  directory, as trainers/paths.py makes every section's), so config.json records where they
  pointed; the same object when there is nothing to change."""
  entries = list(config.get("teachers") or ())
  routes = tuple(config.distill.get("routes", ()) or ()) if "distill" in config else ()
  new_routes = tuple((absolute(str(r[0])) if r[0] != "stdlib" else r[0], *r[1:])
                     if isinstance(r, (tuple, list)) and r else r for r in routes)
  if all(isinstance(entry, ml_collections.ConfigDict) for entry in entries) and all(
      entry.get(k) == absolute(entry.get(k)) for entry in entries for k in ENTRY_PATHS
      if k in entry) and new_routes == routes:
    return config
  out = config.copy_and_resolve_references()
  # Entries as ConfigDicts of their own (a config read back from config.json holds dicts).
  out.teachers = [ml_collections.ConfigDict(dict(entry)) for entry in entries]
  for entry in out.teachers:
    for k in ENTRY_PATHS:
      if k in entry:
        entry[k] = absolute(entry[k])
  if routes:
    out.distill.routes = new_routes
  return out


@dataclasses.dataclass(frozen=True)
class NamedTeacher:
  """One entry of `teachers`: its name, weight, source and model as the step runs it (a cache:
  model_config None, and `writer` the teacher the entry says wrote it, or None)."""

  name: str
  weight: float
  source: ModelSource | CacheHeadSource
  model_config: TransformerConfig | None
  writer: ModelSource | None = None

  @property
  def cached(self) -> bool:
    return isinstance(self.source, CacheHeadSource)

  def manifest(self) -> dict:
    """What the workdir's teacher manifest records of it."""
    return {"name": self.name, "weight": self.weight, "source": self.source.named(),
            "fingerprint": self.source.fingerprint()}


def _cache_source(entry, index: int, vocab_size: int) -> CacheHeadSource:
  """A hidden-state cache standing in for the teacher `entry` names."""
  field = f"teachers[{index}].cache_dir"
  if not os.path.isdir(entry.cache_dir):
    raise ConfigError(f"{field}={entry.cache_dir} does not exist; write the cache there with "
                      f"distillax cache-teacher --kind hidden, or fix the path")
  info = read_cache_info(entry.cache_dir)
  if info.kind != "hidden":
    raise ConfigError(f"{field}={entry.cache_dir} holds a {info.kind} cache; a teacher among "
                      f"several needs its exact logits: write a hidden-state cache with "
                      f"distillax cache-teacher --kind hidden")
  if info.vocab_size != vocab_size:
    raise ConfigError(f"{field}={entry.cache_dir} was written for vocabulary {info.vocab_size}, "
                      f"the student has {vocab_size}; set model.vocab_size={info.vocab_size}")
  return CacheHeadSource(entry.cache_dir, info.head_fingerprint, field)


def _entry_source(entry, index: int, vocab_size: int) -> ModelSource:
  field = f"teachers[{index}]"
  if entry.workdir:
    return RunSource(entry.workdir, f"{field}.workdir", base_of=student_source)
  if entry.hf_path:
    return HFSource(entry.hf_path, f"{field}.hf_path")
  return preset_source(entry.preset, vocab_size, f"{field}.preset", PRESET_SEED_OFFSET + index)


def job_teachers(config, student: ModelSource, student_vocab: int) -> tuple[NamedTeacher, ...]:
  """The `teachers` of `config`, each checked against the student's vocabulary."""
  if "teacher" in config:
    raise ConfigError("this config has both a `teacher` section and a `teachers` list; a job "
                      "distils from one or the other: drop `teacher` (or use configs/distill.py)")
  entries = list(config.get("teachers") or ())
  if not entries:
    raise ConfigError("`teachers` is empty; name at least one teacher, e.g. "
                      "configs/distill_multi_teacher.py")
  out = []
  for i, entry in enumerate(entries):
    name = str(entry.get("name") or "")
    if not name or name in {t.name for t in out}:
      raise ConfigError(f"teachers[{i}].name={name!r} must be a distinct non-empty name "
                        f"(routing rules and the manifest name teachers by it)")
    if entry.get("int8"):
      raise ConfigError(f"teachers[{i}].int8=True: int8 matmuls serve one teacher in the step "
                        f"(configs/distill.py, teacher.int8); set teachers[{i}].int8=False")
    if entry.get("cache_dir"):
      writer = _entry_source(entry, i, student_vocab) if entry.workdir or entry.hf_path else None
      out.append(NamedTeacher(name, float(entry.weight), _cache_source(entry, i, student_vocab),
                              None, writer))
      continue
    source = _entry_source(entry, i, student_vocab)
    cfg = teacher_model_config(entry, source, student_vocab, student,
                               attention_impl=config.model.get("attention_impl", "auto"))
    out.append(NamedTeacher(name, float(entry.weight), source, cfg))
  caches = [f"teachers[{i}].cache_dir" for i, t in enumerate(out) if t.cached]
  if len(caches) > 1 or len(caches) == len(out):
    raise ConfigError(f"{', '.join(caches)} set: several teachers take at most one cache (its "
                      f"rows are the train batches) beside live teachers; clear the others (one "
                      f"teacher from a cache alone: configs/distill_cached.py)")
  return tuple(out)
