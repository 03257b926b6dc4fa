"""One vocabulary for the data, the student and the teacher: the one place it is checked.

The same token ids must mean the same text to every model a job runs. Tokenizer files are
compared by their vocabularies (not just their size); the byte tokenizer by its Hugging Face
form; an spm data tokenizer is not compared. Model vocabulary sizes are compared as well, for
sources without a tokenizer file (presets, byte-tokenized runs).
"""

from __future__ import annotations

import functools
import os

from distillax.data import make_tokenizer
from distillax.errors import ConfigError, UserError
from distillax.models.hf.tokenizer import byte_tokenizer_json
from distillax.trainers.sources import files


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


def _tokenizer_files(sources, data_tokenizer: str, field: str) -> list[tuple[str, str]]:
  """(setting, tokenizer.json) of every tokenizer the job names: teacher, student, data."""
  out = [(s.named(), f) for s in sources if s is not None and (f := s.tokenizer_file())]
  data_file = files.hf_tokenizer_file(data_tokenizer)
  if data_file and not os.path.isfile(data_file):
    make_tokenizer(data_tokenizer)  # raises the one line naming data.tokenizer
  if data_file:
    out.append((f"{field}={data_tokenizer}", data_file))
  return out


CROSS_FIX = ("or distil across tokenizers: --config.distill.objective=cross_tokenizer "
             "--config.teacher.tokenizer=<the teacher's>")


def is_cross_tokenizer(config) -> bool:
  """Whether the job's teacher may have a tokenizer of its own (distill.objective)."""
  return bool(config.get("distill")) and config.distill.get("objective") == "cross_tokenizer"


def teacher_tokenizer_spec(config, teacher_source) -> str:
  """The teacher's tokenizer in a cross-tokenizer job: teacher.tokenizer, else the teacher
  checkpoint's own tokenizer.json, else data.tokenizer."""
  given = str(config.teacher.get("tokenizer", "") or "")
  if given:
    return given
  own = teacher_source.tokenizer_file() if teacher_source is not None else None
  return f"hf:{own}" if own else str(config.data.tokenizer)


def check_job_tokenizers(config, sources) -> None:
  """One tokenizer for data, student and teacher; in a cross-tokenizer job, one for data and
  student and one for the teacher (its source's tokenizer.json against teacher.tokenizer)."""
  if not is_cross_tokenizer(config):
    check_tokenizers([sources.teacher, sources.student], config.data.tokenizer)
    return
  check_tokenizers([sources.student], config.data.tokenizer)
  if sources.teacher is not None:
    check_tokenizers([sources.teacher], teacher_tokenizer_spec(config, sources.teacher),
                     field="teacher.tokenizer")


def check_tokenizers(sources, data_tokenizer: str, field: str = "data.tokenizer") -> None:
  """Refuses a job whose data and model sources (`sources`: teacher first, then student; None
  entries skipped) have different tokenizers (`field`: the setting that names the data's)."""
  named = _tokenizer_files(sources, str(data_tokenizer), field)
  vocabs = [(name, _vocab(file)) for name, file in named]
  if vocabs and str(data_tokenizer) == "byte":
    vocabs.append((f"{field}='byte'", dict(_byte_vocab())))
  if not vocabs:
    return
  first, vocab = vocabs[0]
  for name, theirs in vocabs[1:]:
    if theirs == vocab:
      continue
    if name == f"{field}='byte'":
      raise ConfigError(f"{field}='byte' but {first} comes with its own tokenizer "
                        f"({named[0][1]}); use it: --config.{field}=hf:{named[0][1]}")
    token = next(t for t in sorted(set(vocab) | set(theirs)) if vocab.get(t) != theirs.get(t))
    if field == "teacher.tokenizer":  # a cross-tokenizer job: the teacher's own against it
      raise ConfigError(f"{name} is not the tokenizer {first} comes with ({len(theirs)} vs "
                        f"{len(vocab)} tokens; {token!r} is id {theirs.get(token)} vs "
                        f"{vocab.get(token)}); the teacher reads the tokens it was trained on: "
                        f"leave teacher.tokenizer empty for its own (--config.teacher.tokenizer="
                        f"'') or name that one (--config.teacher.tokenizer=hf:{named[0][1]})")
    raise ConfigError(f"{first} and {name} are different tokenizers ({len(vocab)} vs "
                      f"{len(theirs)} tokens; {token!r} is id {vocab.get(token)} vs "
                      f"{theirs.get(token)}); distillation needs one tokenizer on both sides: "
                      f"use a student and data of the teacher's tokenizer, {CROSS_FIX}")


def check_vocab_sizes(student_source, student_vocab: int, teacher_source, teacher_vocab: int,
                      *, from_scratch: bool = True) -> None:
  """A student and a teacher of different vocabulary sizes cannot share logits. A fresh
  student (`student_source` None or fresh) is told where a student of the teacher's
  vocabulary comes from; `from_scratch`: training one from scratch is a fix worth naming (not
  on-policy, where a random student learns from its own random samples). A teacher table
  padded past the student's (Gemma 3 27B: 262,208 rows over the 1B's 262,144) is fine: the
  tokenizers are one (check_tokenizers), so its extra rows are ids no text reaches, and
  distillation cuts them (distill/base.py)."""
  if teacher_vocab >= student_vocab:
    return
  if student_source is not None and student_source.kind != "fresh":
    raise ConfigError(f"{student_source.named()} has vocab_size={student_vocab} but the teacher "
                      f"({teacher_source.named()}) has {teacher_vocab}; distillation needs one "
                      f"tokenizer on both sides: pick a student of the teacher's family or derive "
                      f"one with --config.student.from_teacher.layers")
  blocks = tuple(range(0, teacher_source.model_config().num_layers, 2))
  scratch = (f"; or, to train a student from scratch, --config.model.vocab_size={teacher_vocab}"
             if from_scratch else "")
  raise ConfigError(f"the teacher ({teacher_source.named()}) has vocab_size={teacher_vocab} but "
                    f"the student, fresh weights of the model section, has {student_vocab} "
                    f"(none of train.init_from, student.hf_path, student.from_teacher.layers is "
                    f"set); start the student from the teacher's family: its blocks "
                    f"(--config.student.from_teacher.layers='{blocks}'), a smaller checkpoint of "
                    f"it (--config.student.hf_path=DIR) or an earlier run of its tokenizer "
                    f"(--config.train.init_from=DIR){scratch}")
