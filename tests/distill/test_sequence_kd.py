"""Sequence-level KD through the CLI: teacher samples written as JSONL, then lm training on them.

With greedy decoding the samples are fixed by the teacher alone, so they are checked against a
second code path: a plain argmax loop over full forward passes (no KV cache, no sampler).
"""

import json
import math
import os

import numpy as np
import pytest

from distillax import main as cli
from distillax.configs import sequence_kd as seqkd_config
from distillax.data import (make_tokenizer, make_train_iterator, resolve_data_config,
                            split_documents)
from distillax.distill.sequence_kd import take_prompts
from distillax.trainers import SequenceKDRecipe
from distillax.models.presets import get_preset
from distillax.models.init import create_model
from tests.support.models import greedy_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "distillax/configs/sequence_kd.py") + ":tiny"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("seqkd") / "run")
  assert cli.main(["distillax", "train", "--config", CONFIG, "--workdir", workdir,
                   "--config.sequence_kd.temperature=0"]) == 0
  config = seqkd_config.get_config("tiny")
  config.sequence_kd.temperature = 0.0
  texts = [json.loads(line)["text"] for line in
           open(os.path.join(workdir, "teacher_samples.jsonl"), encoding="utf-8")]
  return workdir, config, texts


def test_prompts_are_train_document_beginnings(run):
  _, config, texts = run
  sc, tokenizer = config.sequence_kd, make_tokenizer("byte")
  prompts = take_prompts(config.data, tokenizer, count=sc.num_prompts, prompt_len=sc.prompt_len,
                         seed=0)
  assert len(prompts) == len(texts) == sc.num_prompts
  train = split_documents(resolve_data_config(config.data), "train")
  starts = {train[i][:sc.prompt_len - 1] for i in range(len(train))}
  for prompt in prompts:
    assert prompt[0] == tokenizer.bos_id and len(prompt) == sc.prompt_len
    assert tokenizer.decode(prompt) in starts


def test_samples_are_the_teachers_greedy_continuations(run):
  _, config, texts = run
  sc, tokenizer = config.sequence_kd, make_tokenizer("byte")
  prompts = np.stack(take_prompts(config.data, tokenizer, count=sc.num_prompts,
                                  prompt_len=sc.prompt_len, seed=0))
  # The teacher the distillation trainer builds from teacher.preset: fresh weights, seed + 1000.
  teacher = create_model(get_preset("tiny").replace(vocab_size=384), seed=1000)
  # Greedy among the tokenizer's 259 ids: the teacher's 384 rows past them are padding, which
  # its fresh weights would otherwise pick in every row (151 of these 640 tokens).
  tokens = np.concatenate([prompts, greedy_tokens(teacher, prompts, sc.max_new_tokens,
                                                  tokenizer.vocab_size)], axis=1)
  for row, text in zip(tokens, texts):
    eos = np.flatnonzero(row[sc.prompt_len:] == tokenizer.eos_id)
    end = sc.prompt_len + (eos[0] + 1 if eos.size else sc.max_new_tokens)
    assert tokenizer.decode(row[:end]) == text


def test_the_student_trains_on_the_samples(run):
  workdir, config, texts = run
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert summary["finished"] and summary["step"] == config.train.steps
  assert math.isfinite(summary["loss"]) and math.isfinite(summary["eval_loss"])
  # Train batches come from the sample file; eval stays on the original data's validation split.
  trainer = SequenceKDRecipe(config, workdir=workdir)
  it = make_train_iterator(trainer.samples.data_config(), global_batch_size=8, seq_len=32, seed=0)
  row = next(it)
  first = row["inputs_BxL"][0][row["segment_ids_BxL"][0] == row["segment_ids_BxL"][0][0]]
  piece = make_tokenizer("byte").decode(first)
  assert any(piece.replace("\ufffd", "") in t.replace("\ufffd", "") for t in texts)
  saved = json.load(open(os.path.join(workdir, "config.json")))
  assert saved["data"]["source"] == "stdlib" and saved["trainer"] == "sequence_kd"
