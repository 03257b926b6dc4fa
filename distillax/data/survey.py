"""One pass over a job's data before anything compiles: every record is read and checked once,
and a split (or one process's share of it) with no token to train is an error, not a run.

Why up front: the pipeline reads records lazily on its threads, so a bad record (not UTF-8, not
JSON, a chat role no template knows) used to surface steps into training, after the workdir
was written; and a data set whose every record is skipped (chats without an assistant turn under
`data.loss_on='assistant'`) made the packer wait forever for a token. A record with nothing to
train is still skipped, as the pipeline skips it, and how many were is logged once.

What trains is decided without tokenizing: a text has characters, a chat has an assistant turn
(a prompt/completion chat always trains its completion), a prompt/completion pair has a
completion or an EOS. Text files are not read (a non-empty file is a document). The first
record that should train in each share is then tokenized as the pipeline does, so the verdict is
the pipeline's own; a record that trains nothing after all counts as skipped and the next is
tried.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from absl import logging

from distillax.data import chat
from distillax.data.pipeline import (TokenizeDocument, check_shardable, resolve_data_config,
                                     split_documents)
from distillax.data.records import ChatRecord, PromptCompletion, RecordLayout
from distillax.data.sources import Documents, TextFiles, load_documents
from distillax.data.tokenizer import Tokenizer
from distillax.errors import UserError

SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class Survey:
  """What the pass found: records per split and, of those, how many have nothing to train."""

  records: dict[str, int]
  skipped: dict[str, int]


def check_data(data_cfg, tokenizer: Tokenizer, *, process_count: int = 1,
               splits: tuple[str, ...] = SPLITS) -> Survey:
  """Reads every record of `data_cfg`'s source (and eval source) once, raising the first bad
  one's UserError; refuses each split in `splits` (or a process's share of it) that has no
  token to train; logs once how many records are skipped. Returns the counts."""
  cfg = resolve_data_config(data_cfg)
  docs = _splits(cfg, tokenizer.eos_id is not None)
  tokenize = TokenizeDocument(tokenizer, cfg.add_bos,
                              chat.template_for(tokenizer, cfg.chat_template), cfg.loss_on)
  for name in splits:
    documents, trains, records = docs[name]
    check_shardable(documents, process_count)
    for p in range(process_count):
      shard = np.arange(p, len(documents), process_count)
      if not _confirm_one(documents, trains, shard, tokenize):
        raise UserError(_nothing_to_train(cfg, name, len(shard), (p, process_count),
                                          texts_only=not records[shard].any()))
  survey = Survey({n: int(r.sum()) for n, (_, _, r) in docs.items()},
                  {n: int((r & ~t).sum()) for n, (_, t, r) in docs.items()})
  if sum(survey.skipped.values()):
    logging.warning("data: %s have nothing to train (%s) and are skipped", ", ".join(
        f"{survey.skipped[n]} of the {survey.records[n]} {n} records" for n in docs),
                    _what_trains(cfg.loss_on))
  return survey


def _splits(cfg, has_eos: bool) -> dict[str, tuple[Documents, np.ndarray, np.ndarray]]:
  """{split: (its documents as pipeline.split_documents makes them, whether each trains,
  whether each is a record)}; every record of a file is read once, also when eval is the
  source's validation split."""
  layout = RecordLayout.from_config(cfg)
  load = lambda spec: load_documents(spec, cfg.format, cfg.text_field, layout)
  if cfg.eval_source:
    train, evaluation = load(cfg.source), load(cfg.eval_source)
    docs = {"train": (train, *_trains(train, cfg.loss_on, has_eos)),
            "eval": (evaluation, *_trains(evaluation, cfg.loss_on, has_eos))}
  else:
    everything = load(cfg.source)
    trains, records = _trains(everything, cfg.loss_on, has_eos)
    train, evaluation = everything.split(cfg.validation_fraction)
    docs = {name: (d, trains[d.indices], records[d.indices])
            for name, d in (("train", train), ("eval", evaluation))}
  for name, (documents, _, _) in docs.items():
    if len(documents) == 0:
      split_documents(cfg, name)  # raises that split's one-line error
  return docs


def _trains(documents: Documents, loss_on: str, has_eos: bool) -> tuple[np.ndarray, np.ndarray]:
  """(whether each of all the documents of `documents`' files has a token to train, whether it
  is a record): an empty text file (an empty __init__.py) is skipped, but is not a record the
  user wrote to be trained, so it is not counted."""
  trains = [_part_trains(part, loss_on, has_eos) for part in documents.parts]
  records = [np.full(len(part), not isinstance(part, TextFiles)) for part in documents.parts]
  return np.concatenate(trains), np.concatenate(records)


def _part_trains(part, loss_on: str, has_eos: bool) -> np.ndarray:
  if isinstance(part, TextFiles):
    return np.array([os.path.getsize(f) > 0 for f in part.files], bool)
  records = part.records() if hasattr(part, "records") else (part[j] for j in range(len(part)))
  return np.fromiter((_record_trains(r, loss_on, has_eos) for r in records), bool, len(part))


def _record_trains(document, loss_on: str, has_eos: bool) -> bool:
  if isinstance(document, str):
    return bool(document)
  if loss_on == "all":
    return True
  if isinstance(document, ChatRecord):
    return document.prompt_messages is not None or any(
        m.get("role") == "assistant" for m in document.messages)
  assert isinstance(document, PromptCompletion)
  return bool(document.completion) or has_eos


def _confirm_one(documents: Documents, trains: np.ndarray, shard: np.ndarray,
                 tokenize: TokenizeDocument) -> bool:
  """Whether a document of `shard` gives the pipeline a token to train; one that should but
  does not is marked as skipped in `trains`."""
  for i in shard[trains[shard]]:
    out = tokenize.map(documents[int(i)])
    if len(out[0] if isinstance(out, tuple) else out):
      return True
    trains[i] = False
  return False


def _what_trains(loss_on: str) -> str:
  if loss_on == "all":
    return "empty records"
  return ("with data.loss_on='assistant' a chat trains its assistant turns: these have none, "
          "or are empty")


def _nothing_to_train(cfg, split: str, count: int, process: tuple[int, int],
                      texts_only: bool) -> str:
  source = cfg.eval_source if split == "eval" and cfg.eval_source else cfg.source
  process, process_count = process
  where = (f"the {count} {split} records of data source {source!r}" if process_count == 1 else
           f"process {process}'s share ({count} {split} records) of data source {source!r}")
  if texts_only or cfg.loss_on == "all":
    why, fix = "all are empty", "add documents"
  else:
    why = ("none is a chat with an assistant turn or a completion (data.loss_on='assistant' "
           "trains only those)")
    fix = ("add records with the assistant's answers, or set --config.data.loss_on=all to "
           "train on every token")
  if split == "eval" and not cfg.eval_source:
    fix += ", or raise data.validation_fraction or set data.eval_source"
  elif process_count > 1:
    fix += ", or run fewer processes"
  return f"{where} have no token to train: {why}; {fix}"
