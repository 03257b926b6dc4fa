"""The student a recipe starts from: fresh weights, an earlier run's (`train.init_from`), a
Hugging Face checkpoint (`student.hf_path`, or `train.init_from` naming one) or blocks copied
from the teacher (`student.from_teacher.layers`).

A student whose weights come from a checkpoint or the teacher has that source's shape.
`resolve_student` writes the source's model config into the config's `model` section, so the
run's config.json describes the model exactly and loading the run later never reads the source
again; only how the model runs (RUN_FIELDS) stays the `model` section's. A `--config.model.*`
override that disagrees with the source is an error, not a silently different model.

Every source is read sharded, tensor by tensor: a Hugging Face student through `hf.load`, a
derived one from the teacher as its own source loads it (an earlier run, a checkpoint, a
preset), then its chosen blocks are placed with the student's shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx

from distillax import partitioning as pt
from distillax.data import make_tokenizer, padded_vocab_size
from distillax.errors import ConfigError, UserError
from distillax.models import hf
from distillax.models.config import TransformerConfig
from distillax.models.hf_tokenizer import byte_tokenizer_json
from distillax.models.init import abstract_model, create_model
from distillax.models.transformer import layer_params
from distillax.trainers import teacher as teachers
from distillax.trainers.runs import (hf_checkpoint_config, is_hf_checkpoint, load_trained_model,
                                     trained_model_config)
from distillax.trainers.workdir import CHECKPOINT_DIR

# The model fields that say how a model runs, not what it is: a student from a checkpoint or
# the teacher keeps the config's values of these (e.g. fp32 master weights of a bf16 checkpoint).
RUN_FIELDS = ("param_dtype", "dtype", "scan_layers", "remat")


@dataclasses.dataclass(frozen=True)
class StudentSource:
  """Where the student's first weights come from. kind: fresh | run | hf | teacher."""

  kind: str
  field: str = ""  # the setting that names it, e.g. "student.hf_path"
  path: str = ""
  layers: tuple[int, ...] = ()

  def named(self) -> str:
    """`field=value` as the user wrote it, for error lines."""
    value = self.path if self.kind != "teacher" else str(self.layers)
    return f"{self.field}={value}"


def student_source(config) -> StudentSource:
  """The one source the config names; more than one is an error naming them."""
  student = config.get("student") or {}
  init_from = str(config.train.get("init_from", "") or "")
  hf_path = str(student.get("hf_path", "") or "") if student else ""
  layers = tuple(student.get("from_teacher", {}).get("layers", ()) or ()) if student else ()
  named = [name for name, value in (("train.init_from", init_from),
                                    ("student.hf_path", hf_path),
                                    ("student.from_teacher.layers", layers)) if value]
  if len(named) > 1:
    raise ConfigError(f"{' and '.join(named)} are both set; the student starts from one place: "
                      f"clear all but one")
  if init_from:
    kind = "hf" if is_hf_checkpoint(init_from) else "run"
    return StudentSource(kind, "train.init_from", init_from)
  if hf_path:
    return StudentSource("hf", "student.hf_path", hf_path)
  if layers:
    if "teacher" not in config:
      raise ConfigError("student.from_teacher.layers is set but this config has no teacher "
                        "section; use a distillation config")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
      raise ConfigError(f"student.from_teacher.layers={layers!r} must be teacher block indices "
                        f"(whole numbers from 0), e.g. --config.student.from_teacher.layers="
                        f"'(0, 2, 4)'")
    twice = sorted({i for i in layers if layers.count(i) > 1})
    if twice:
      raise ConfigError(f"student.from_teacher.layers={layers!r} names block(s) {twice} more "
                        f"than once; each teacher block is copied into the student once: list "
                        f"distinct blocks, e.g. {tuple(dict.fromkeys(layers))}")
    return StudentSource("teacher", "student.from_teacher.layers", layers=layers)
  return StudentSource("fresh")


def _tokenizer_vocab(config) -> int:
  """The model vocabulary the data's tokenizer implies (model.vocab_size, else padded)."""
  given = int(config.model.get("vocab_size") or 0)
  return given if given > 0 else padded_vocab_size(make_tokenizer(config.data.tokenizer))


def source_model_config(source: StudentSource, config) -> TransformerConfig | None:
  """The model config the source gives the student (before RUN_FIELDS); None for a fresh
  student or an earlier run (whose shape the model section must already match)."""
  if source.kind == "hf":
    return hf_checkpoint_config(source.path, source.field)
  if source.kind != "teacher":
    return None
  teacher = teachers.teacher_source_config(config.teacher, _tokenizer_vocab(config))
  outside = [i for i in source.layers if i >= teacher.num_layers]
  if outside:
    raise ConfigError(f"{source.named()} names blocks {outside} but the teacher has "
                      f"{teacher.num_layers} (0..{teacher.num_layers - 1}); pick blocks it has")
  return teacher.select_layers(source.layers)  # each block keeps its attention type


def _check_overrides(source: StudentSource, want: dict, overrides) -> None:
  """A `--config.model.X=v` the source contradicts is the user asking for two models."""
  for key, value in (overrides or {}).items():
    name = key.removeprefix("model.")
    if not key.startswith("model.") or name in RUN_FIELDS or name not in want:
      continue
    if value != want[name]:
      why = (f" (the layer count is len({source.field}))" if name == "num_layers"
             and source.kind == "teacher" else "")
      raise ConfigError(f"--config.model.{name}={value!r} disagrees with {source.named()}, "
                        f"whose model has {name}={want[name]!r}{why}; a student with weights "
                        f"from there has their shape: drop the override")


def _check_teacher_vocab(source: StudentSource, student: TransformerConfig, config) -> None:
  """A checkpoint student and the teacher must share one vocabulary for logit distillation."""
  teacher = config.get("teacher")
  if source.kind != "hf" or teacher is None or teacher.get("cache_dir"):
    return
  theirs = teachers.teacher_source_config(teacher, student.vocab_size).vocab_size
  if theirs != student.vocab_size:
    where = teacher.workdir or teacher.hf_path or f"preset {teacher.preset}"
    raise ConfigError(f"{source.named()} has vocab_size={student.vocab_size} but the teacher "
                      f"({where}) has {theirs}; distillation needs one tokenizer on both sides: "
                      f"pick a student of the teacher's family or derive one with "
                      f"--config.student.from_teacher.layers")


def resolve_student(config, overrides=None):
  """`config` with the model section its student source implies (the same object when there
  is nothing to change). overrides: the command line's `--config.*` values by dotted name, to
  refuse model fields that contradict the source; None when unknown (the Python API)."""
  check_tokenizers(config)
  source = student_source(config)
  cfg = source_model_config(source, config)
  if cfg is None:
    return config
  _check_teacher_vocab(source, cfg, config)
  want = cfg.to_dict()
  _check_overrides(source, want, overrides)
  want.update({k: config.model[k] for k in RUN_FIELDS if k in config.model})
  if all(config.model.get(k) == v for k, v in want.items()):
    return config
  out = config.copy_and_resolve_references()
  for key, value in want.items():
    out.model[key] = value
  return out


# ---- tokenizers: one vocabulary for the data, the student and the teacher --------------------

@functools.lru_cache(maxsize=16)
def _vocab_at(file: str, mtime: float) -> tuple[tuple[str, int], ...]:
  import tokenizers  # the hf extra; only reached when a tokenizer.json is named
  try:
    vocab = tokenizers.Tokenizer.from_file(file).get_vocab(with_added_tokens=True)
  except Exception as e:  # tokenizers raises a bare Exception for unreadable files
    raise UserError(f"{file} is not a readable tokenizer.json ({e}); fix or replace it") from None
  return tuple(sorted(vocab.items()))


def _vocab(file: str) -> dict[str, int]:
  return dict(_vocab_at(os.path.realpath(file), os.path.getmtime(file)))


@functools.lru_cache(maxsize=1)
def _byte_vocab() -> tuple[tuple[str, int], ...]:
  """The vocabulary of the byte tokenizer's Hugging Face form (what an export of a byte run
  carries), so such a checkpoint counts as the byte tokenizer it is."""
  import tokenizers
  vocab = tokenizers.Tokenizer.from_str(byte_tokenizer_json()).get_vocab(with_added_tokens=True)
  return tuple(sorted(vocab.items()))


def _tokenizer_files(config) -> list[tuple[str, str]]:
  """(setting, tokenizer.json) of every tokenizer this job names: teacher, student, data."""
  out = []
  teacher = config.get("teacher")
  if teacher is not None and (teacher.get("workdir") or teacher.get("hf_path")):
    file = teachers.teacher_tokenizer_file(teacher)
    if file:
      where = "teacher.workdir" if teacher.workdir else "teacher.hf_path"
      out.append((f"{where}={teacher.workdir or teacher.hf_path}", file))
  source = student_source(config)
  if source.kind == "hf" and os.path.isfile(os.path.join(source.path, "tokenizer.json")):
    out.append((source.named(), os.path.join(source.path, "tokenizer.json")))
  data_file = teachers.hf_tokenizer_file(config.data.tokenizer)
  if data_file and not os.path.isfile(data_file):
    make_tokenizer(config.data.tokenizer)  # raises the one line naming data.tokenizer
  if data_file:
    out.append((f"data.tokenizer={config.data.tokenizer}", data_file))
  return out


def check_tokenizers(config) -> None:
  """Refuses a job whose data, student or teacher tokenizers differ: the same ids would mean
  different text to each (checked on the tokenizer files' vocabularies, not just their size;
  the byte tokenizer by its Hugging Face form). An spm data tokenizer is not compared."""
  files = _tokenizer_files(config)
  vocabs = [(name, _vocab(file)) for name, file in files]
  spec = str(config.data.tokenizer)
  if vocabs and spec == "byte":
    vocabs.append(("data.tokenizer='byte'", dict(_byte_vocab())))
  if not vocabs:
    return
  first, vocab = vocabs[0]
  for name, theirs in vocabs[1:]:
    if theirs == vocab:
      continue
    if name == "data.tokenizer='byte'":
      raise ConfigError(f"data.tokenizer='byte' but {first} comes with its own tokenizer "
                        f"({files[0][1]}); tokenize the data with it: "
                        f"--config.data.tokenizer=hf:{files[0][1]}")
    token = next(t for t in sorted(set(vocab) | set(theirs)) if vocab.get(t) != theirs.get(t))
    raise ConfigError(f"{first} and {name} are different tokenizers ({len(vocab)} vs "
                      f"{len(theirs)} tokens; {token!r} is id {vocab.get(token)} vs "
                      f"{theirs.get(token)}); distillation needs one tokenizer on both sides: "
                      f"use a student and data of the teacher's tokenizer")


# ---- the student's weights ---------------------------------------------------------------------

def check_init_from(config, cfg: TransformerConfig) -> None:
  """Refuses a `train.init_from` run the student cannot start from, before anything is built or
  a workdir is touched: not a distillax run, no checkpoints yet, or a model of another shape
  than `cfg` (this config's). A Hugging Face directory is a source of its own (resolve_student)."""
  init_from = str(config.train.get("init_from", "") or "")
  if not init_from or is_hf_checkpoint(init_from):
    return
  earlier = trained_model_config(init_from, field="train.init_from")
  if not os.path.isdir(os.path.join(init_from, CHECKPOINT_DIR)):
    raise ConfigError(f"train.init_from={init_from} has no {CHECKPOINT_DIR}/ yet; train that "
                      f"run first or leave train.init_from empty")
  if earlier != cfg:
    diff = [f.name for f in dataclasses.fields(cfg)
            if getattr(earlier, f.name) != getattr(cfg, f.name)]
    fix = " ".join(f"--config.model.{k}={getattr(earlier, k)!r}" for k in diff[:4])
    raise ConfigError(f"train.init_from={init_from} holds a model with "
                      + ", ".join(f"{k}={getattr(earlier, k)!r}" for k in diff)
                      + " but this config's model has "
                      + ", ".join(f"{k}={getattr(cfg, k)!r}" for k in diff)
                      + f"; make the model section match it, e.g. {fix}")


def base_student(cfg: TransformerConfig, config, mesh, rules, *, abstract: bool) -> nnx.Module:
  """The plain Transformer before any transform. Abstract modules hold shapes only; real ones
  are created or read sharded (no host ever holds the whole model)."""
  seed = int(config.seed)
  if abstract:
    return abstract_model(cfg, seed)
  source = student_source(config)
  if source.kind == "fresh":
    return create_model(cfg, mesh=mesh, rules=rules, seed=seed)
  if source.kind == "run":
    model = load_trained_model(source.path, mesh, rules)
  elif source.kind == "hf":
    run_fields = {k: getattr(cfg, k) for k in RUN_FIELDS}
    model = hf.load(source.path, mesh=mesh, rules=rules, **run_fields)
  else:
    teacher = teachers.load_teacher(teachers.as_stored(config.teacher), cfg.vocab_size, mesh,
                                    rules, seed=seed)
    model = select_layers(teacher, source.layers, cfg, mesh, rules)
  if model.config != cfg:
    raise ConfigError(f"{source.named()} holds a model of another shape ({model.config}); make "
                      f"the model section match it")
  return model


def select_layers(teacher: nnx.Module, layers, cfg: TransformerConfig, mesh, rules) -> nnx.Module:
  """A model of config `cfg` made of the teacher's embeddings, final norm, head and blocks
  `layers` (in that order), cast to cfg's param_dtype and placed with its shardings. The
  arrays move device to device; none is gathered on a host."""
  per_layer = layer_params(teacher)
  picked = [per_layer[i] for i in layers]
  values = {k: v for k, v in nnx.to_pure_dict(nnx.state(teacher)).items() if k != "layers"}
  values["layers"] = (jax.tree.map(lambda *a: jnp.stack(a), *picked) if cfg.scan_layers
                      else dict(enumerate(picked)))
  graphdef, abstract = nnx.split(abstract_model(cfg))
  want = nnx.to_pure_dict(abstract)
  values = jax.tree.map(lambda v, w: v.astype(w.dtype), values, want)
  shardings = pt.tree_shardings(want, pt.logical_tree(abstract), mesh, rules)
  nnx.replace_by_pure_dict(abstract, jax.device_put(values, shardings))
  return nnx.merge(graphdef, abstract)
