"""Byte-level BPE tokenizers trained in the test on the embedded corpus (no downloads)."""

from __future__ import annotations

import os

from tests.data.chat_testing import corpus_sentences, training_lines


def trained_bpe(folder, vocab_size: int) -> str:
  """A byte-level BPE of `vocab_size` ids (<pad>, <s>, </s> first) trained on the corpus and
  sentences carrying non-ASCII text, saved as folder/tokenizer.json; returns the path."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(training_lines() + corpus_sentences(300, seed=1), trainer)
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(str(folder), "tokenizer.json")
  tok.save(path)
  return path
