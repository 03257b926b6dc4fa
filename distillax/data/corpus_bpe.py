"""Byte-level BPE tokenizers trained on the embedded corpus, so that jobs that need two different
tokenizers (cross-tokenizer distillation's `:tiny`) run with nothing downloaded.

`corpus_bpe(vocab_size)` trains one (<pad>, <s>, </s> first; a few hundred milliseconds) on
the standard library's os.py and saves it once as <cache>/corpus_bpe_<vocab>/tokenizer.json;
later calls reuse the file. The cache is $DISTILLAX_CACHE, else ~/.cache/distillax.
"""

from __future__ import annotations

import os
import tempfile

from distillax.data.sources import stdlib_files
from distillax.errors import ConfigError

SPECIALS = ("<pad>", "<s>", "</s>")


def cache_dir() -> str:
  return os.environ.get("DISTILLAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "distillax")


def _corpus_lines() -> list[str]:
  root, _ = stdlib_files()
  with open(os.path.join(root, "os.py"), encoding="utf-8") as f:
    return [line for line in f.read().splitlines() if line.strip()]


def corpus_bpe(vocab_size: int) -> str:
  """The path of a tokenizer.json of `vocab_size` ids trained on the embedded corpus."""
  if int(vocab_size) < 300:
    raise ConfigError(f"corpus_bpe(vocab_size={vocab_size}): a byte-level BPE needs >= 300 ids "
                      f"(256 bytes, specials, merges)")
  folder = os.path.join(cache_dir(), f"corpus_bpe_{int(vocab_size)}")
  path = os.path.join(folder, "tokenizer.json")
  if os.path.isfile(path):
    return path
  import tokenizers  # the hf extra
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), special_tokens=list(SPECIALS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(_corpus_lines(), trainer)
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, suffix=".json")  # whole file or none, for parallel runs
  os.close(fd)
  tok.save(tmp)
  os.replace(tmp, path)
  return path
