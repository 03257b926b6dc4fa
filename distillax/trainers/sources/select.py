"""Which source a job's student and teacher come from, read once per job.

Student, first set wins (more than one is an error naming them): `train.init_from` (an earlier
run, or a Hugging Face directory), `student.hf_path`, `student.from_teacher.layers` (blocks of
the teacher), else fresh weights of the model section. Teacher: `teacher.workdir` (a run),
`teacher.hf_path`, `teacher.preset` (fresh weights: tests, benchmarks); a `teacher.cache_dir`
holds teacher *outputs*, not a model, so such a job has no teacher source. `teacher.int8` runs
the teacher of the step with int8 matmul weights (kinds.Int8Source); what the job reads of the
teacher otherwise (its config, tokenizer, the blocks a derived student copies) is the stored one.
The teacher's attention runs as `teacher.attention_impl` says, '' (the default) as the student's
`model.attention_impl`: which kernel runs is the platform's choice, not the checkpoint's.

A student whose weights come from a source has that source's shape: `resolve_student` writes
the source's model config into the config's `model` section, so the run's config.json describes
the model exactly; only how the model runs (RUN_FIELDS; for an earlier run, whose checkpoint
holds arrays of its own dtype and layout, COMPUTE_FIELDS) stays the `model` section's; both
lists are the field kinds TransformerConfig declares. A command-line `--config.model.*` value
that disagrees with the source is an error, not a silently different model: the CLI passes the
values it was given as `model_overrides`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from distillax.data import make_tokenizer, padded_vocab_size
from distillax.errors import ConfigError
from distillax.models.config import (ATTENTION_IMPLS, COMPUTE, TransformerConfig,
                                     fields_of_kind)
from distillax.models.presets import PRESETS, get_preset
from distillax.trainers.sources import files, vocabulary
from distillax.trainers.sources.kinds import (RUN_FIELDS, BlocksSource, FreshSource, HFSource,
                                              Int8Source, ModelSource, RunSource, preset_source)

# Model fields that say how the forward computes, not what a checkpoint stores: all that a
# student from an earlier run may change (RunSource.load places the loaded student as this
# config's model).
COMPUTE_FIELDS = fields_of_kind(COMPUTE)
# Fresh preset teachers draw from their own seed stream, apart from the student's.
PRESET_SEED_OFFSET = 1000
# A preset teacher takes the student's vocabulary, unless its own table is that vocabulary
# padded by at most this many rows (Gemma 3 27B: 262,208 rows over the 1B's 262,144), which
# distillation cuts away (distill/base.py): plans then size the teacher as it ships.
MAX_PADDING_ROWS = 1024

def _vocab_of(config) -> int:
  """The model vocabulary the data's tokenizer implies (model.vocab_size, else padded)."""
  given = int(config.model.get("vocab_size") or 0)
  return given if given > 0 else padded_vocab_size(make_tokenizer(config.data.tokenizer))


def teacher_source(teacher, vocab_size: int) -> ModelSource | None:
  """The teacher section's source (int8 with `teacher.int8`); None when the job trains from a
  teacher cache."""
  if teacher is None or teacher.get("cache_dir"):
    return None
  source = _stored_teacher_source(teacher, vocab_size)
  return Int8Source(source) if teacher.get("int8") else source


def _stored_teacher_source(teacher, vocab_size: int) -> ModelSource:
  if teacher.workdir:
    return RunSource(teacher.workdir, "teacher.workdir", base_of=student_source)
  if teacher.hf_path:
    return HFSource(teacher.hf_path, "teacher.hf_path")
  own = get_preset(teacher.preset).vocab_size if teacher.preset in PRESETS else 0
  if vocab_size < own <= vocab_size + MAX_PADDING_ROWS:  # a padded table keeps its rows
    vocab_size = own
  return preset_source(teacher.preset, vocab_size, "teacher.preset", PRESET_SEED_OFFSET)


def _check_layers(layers) -> None:
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
    raise ConfigError(f"student.from_teacher.layers={layers!r} must be teacher block indices "
                      f"(whole numbers from 0), e.g. --config.student.from_teacher.layers="
                      f"'(0, 2, 4)'")
  twice = sorted({i for i in layers if layers.count(i) > 1})
  if twice:
    raise ConfigError(f"student.from_teacher.layers={layers!r} names block(s) {twice} more "
                      f"than once; each teacher block is copied into the student once: list "
                      f"distinct blocks, e.g. {tuple(dict.fromkeys(layers))}")


def student_source(config, teacher: ModelSource | None = None) -> ModelSource:
  """The one source the config names for its student (`teacher`: the job's teacher source,
  which a derived student copies blocks of; made from the config when not given)."""
  student = config.get("student") or {}
  init_from = str(config.train.get("init_from", "") or "")
  hf_path = str(student.get("hf_path", "") or "") if student else ""
  from_teacher = (student.get("from_teacher") or {}) if student else {}
  layers = tuple(from_teacher.get("layers", ()) or ())
  kept = tuple(from_teacher.get("experts", ()) or ())
  named = [name for name, value in (("train.init_from", init_from),
                                    ("student.hf_path", hf_path),
                                    ("student.from_teacher.layers", layers)) if value]
  if len(named) > 1:
    raise ConfigError(f"{' and '.join(named)} are both set; the student starts from one place: "
                      f"clear all but one")
  if init_from:
    if files.is_hf_checkpoint(init_from):
      return HFSource(init_from, "train.init_from")
    return RunSource(init_from, "train.init_from", base_of=student_source)
  if hf_path:
    return HFSource(hf_path, "student.hf_path")
  if layers:
    if "teacher" not in config:
      raise ConfigError(_no_single_teacher(config))
    _check_layers(layers)
    of = teacher or teacher_source(_as_stored(config.teacher), _vocab_of(config))
    return BlocksSource(of, layers, experts=kept)
  if kept:
    raise ConfigError(f"student.from_teacher.experts={kept!r} keeps teacher experts, but the "
                      f"student copies no teacher blocks; set student.from_teacher.layers too, "
                      f"e.g. --config.student.from_teacher.layers='(0, 1)'")
  return FreshSource(None, "")


def _no_single_teacher(config) -> str:
  """Why student.from_teacher.layers has no teacher to copy, and the fix."""
  if "teachers" not in config:
    return ("student.from_teacher.layers is set but this config has no teacher section; use a "
            "distillation config, e.g. distillax/configs/distill.py")
  return (f"student.from_teacher.layers copies blocks of one teacher, but this job distils from "
          f"{len(config.teachers)} (the `teachers` list), so which one's is not said; derive the "
          f"student in a single-teacher run (distillax/configs/distill.py with that teacher "
          f"and --config.student.from_teacher.layers) and start this job from it with "
          f"--config.train.init_from=<its workdir>, or clear student.from_teacher.layers")


def _as_stored(teacher):
  """The teacher section without its cache and int8: a derived student copies the source's own
  model even when the job distils from a cache or runs its teacher in int8."""
  out = teacher.copy_and_resolve_references()
  if "cache_dir" in out:
    out.cache_dir = ""
  if "int8" in out:
    out.int8 = False
  return out


@dataclasses.dataclass(frozen=True)
class JobSources:
  """A job's student and teacher sources, each made once (a derived student shares the
  teacher's). `teacher` is None without a teacher section; `cached`: the job distils from a
  teacher cache, so no teacher runs in its step (its source still names the tokenizer)."""

  student: ModelSource
  teacher: ModelSource | None
  cached: bool = False
  int8: bool = False  # teacher.int8: the step's teacher runs int8 matmuls

  @property
  def step_teacher(self) -> ModelSource | None:
    """The teacher that runs inside the step."""
    if self.cached or self.teacher is None:
      return None
    return Int8Source(self.teacher) if self.int8 else self.teacher


def job_sources(config) -> JobSources:
  teacher = None
  if "teacher" in config:
    teacher = teacher_source(_as_stored(config.teacher), _vocab_of(config))
  cached = "teacher" in config and bool(config.teacher.get("cache_dir"))
  int8 = "teacher" in config and bool(config.teacher.get("int8"))
  if int8 and cached:
    raise ConfigError(f"teacher.int8=True runs the teacher in the step with int8 matmuls, but "
                      f"teacher.cache_dir={config.teacher.cache_dir} replaces it with its cached "
                      f"outputs; clear one of them")
  return JobSources(student_source(config, teacher), teacher, cached, int8)


def _check_overrides(source: ModelSource, want: dict, kept: tuple[str, ...],
                     overrides: Mapping | None) -> None:
  """A `--config.model.X=v` the source contradicts is the user asking for two models (`kept`:
  the fields the config may choose whatever the source holds). `overrides`: the values the
  user set by dotted name (the CLI's); None (the Python API: unknown) checks none."""
  for key, value in (overrides or {}).items():
    name = key.removeprefix("model.")
    if not key.startswith("model.") or name in kept or name not in want:
      continue
    if value != want[name]:
      why = (f" (the layer count is len({source.field}))" if name == "num_layers"
             and source.kind == "teacher" else "")
      raise ConfigError(f"--config.model.{name}={value!r} disagrees with {source.named()}, "
                        f"whose model has {name}={want[name]!r}{why}; a student with weights "
                        f"from there has their shape: drop the override")


def resolve_student(config, sources: JobSources, model_overrides: Mapping | None = None):
  """`config` with the model section its student source implies (the same object when there
  is nothing to change); the tokenizers of data, student and teacher checked to be one, and
  the `--config.*` values the user set (`model_overrides`) against the source."""
  vocabulary.check_job_tokenizers(config, sources)
  source = sources.student
  if source.kind == "fresh":
    return config
  cfg: TransformerConfig = source.model_config()
  if sources.teacher is not None and source.kind == "hf" and sources.teacher.kind != "fresh" \
      and not vocabulary.is_cross_tokenizer(config):
    vocabulary.check_vocab_sizes(source, cfg.vocab_size, sources.teacher,
                                 sources.teacher.model_config().vocab_size)
  want = cfg.to_dict()
  # An earlier run's checkpoint holds its arrays in its own dtype and layer layout, so a run
  # keeps those too; only how the forward computes may change.
  kept = COMPUTE_FIELDS if source.kind == "run" else RUN_FIELDS
  _check_overrides(source, want, kept, model_overrides)
  if source.kind == "run" and not source.run_config.model.get("vocab_size"):
    want["vocab_size"] = 0  # as the run has it (its tokenizer's size): the same job identity
  want.update({k: config.model[k] for k in kept if k in config.model})
  if all(config.model.get(k) == v for k, v in want.items()):
    return config
  out = config.copy_and_resolve_references()
  for key, value in want.items():
    out.model[key] = value
  return out


def check_run_shape(source: ModelSource, cfg: TransformerConfig) -> None:
  """Refuses an earlier run the student cannot start from, before anything is built or a
  workdir is touched: no checkpoints yet, or a model of another shape than `cfg` (the model
  section has the run's, resolve_student wrote it there; a vocabulary of 0 is this job's
  tokenizer's, which may differ from the run's)."""
  if source.kind != "run":
    return
  earlier = source.model_config()
  if not os.path.isdir(os.path.join(source.workdir, files.CHECKPOINT_DIR)):
    raise ConfigError(f"{source.named()} has no {files.CHECKPOINT_DIR}/ yet; train that "
                      f"run first or leave {source.field} empty")
  # How the forward computes (not what is stored) may change between runs: the loaded student
  # is placed as this config's model (RunSource.load).
  diff = [f.name for f in dataclasses.fields(cfg) if f.name not in COMPUTE_FIELDS
          and getattr(earlier, f.name) != getattr(cfg, f.name)]
  if diff:
    fix = " ".join(f"--config.model.{k}={getattr(earlier, k)!r}" for k in diff[:4])
    raise ConfigError(f"{source.named()} holds a model with "
                      + ", ".join(f"{k}={getattr(earlier, k)!r}" for k in diff)
                      + " but this config's model has "
                      + ", ".join(f"{k}={getattr(cfg, k)!r}" for k in diff)
                      + f"; make the model section match it, e.g. {fix}")


def teacher_model_config(teacher_section, source: ModelSource | None, student_vocab: int,
                         student: ModelSource | None = None, *, from_scratch: bool = True,
                         attention_impl: str = "auto") -> TransformerConfig | None:
  """The teacher as the step runs it: its source's model with the section's dtype overrides,
  checked against the vocabulary of the student (`student`: its source, which the error names;
  `from_scratch`: whether a fresh student is a fix worth naming); None without a teacher model
  (a cache). Its attention runs as the section's attention_impl says, else as the student's
  (`attention_impl`: the model section's), never as its source stored it: the choice is the
  platform's (a GPU target without cuDNN needs blockwise in both models)."""
  if source is None:
    return None
  cfg = source.model_config()
  overrides = {k: teacher_section[k] for k in ("param_dtype", "dtype") if teacher_section[k]}
  overrides["attention_impl"] = _teacher_attention(teacher_section, attention_impl)
  cfg = cfg.replace(**overrides)
  vocabulary.check_vocab_sizes(student, student_vocab, source, cfg.vocab_size,
                               from_scratch=from_scratch)
  return cfg


def _teacher_attention(teacher_section, student_impl: str) -> str:
  own = str(teacher_section.get("attention_impl") or "")
  if own and own not in ATTENTION_IMPLS:
    raise ConfigError(f"teacher.attention_impl={own!r}; choose one of "
                      f"{', '.join(ATTENTION_IMPLS)}, or '' for the student's "
                      f"(model.attention_impl)")
  return own or str(student_impl or "auto")


def job_teacher(config, sources: JobSources, student_vocab: int
                ) -> tuple[ModelSource | None, TransformerConfig | None]:
  """(source, model config as the step runs it) of the teacher that runs in a job's step;
  (None, None) when it distils from a cache. A preset teacher takes the student's vocabulary."""
  teacher = sources.step_teacher
  if teacher is not None and teacher.kind == "fresh":
    teacher = teacher_source(config.teacher, student_vocab)
  # On-policy, a random student would learn from its own random samples: no fix to suggest.
  return teacher, teacher_model_config(config.teacher, teacher, student_vocab, sources.student,
                                       from_scratch=config.get("trainer") != "on_policy",
                                       attention_impl=config.model.get("attention_impl", "auto"))
