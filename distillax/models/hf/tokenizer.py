"""The files next to a Hugging Face export's weights that make it usable as it is: the tokenizer
(with its chat template) and generation_config.json, so that `AutoTokenizer.from_pretrained`,
`apply_chat_template` and `AutoModelForCausalLM.generate` need no extra step.

A `hf:` tokenizer's folder is copied file by file (tokenizer.json, tokenizer_config.json,
special_tokens_map.json, chat_template.jinja, generation_config.json, ...); what it lacks is
written from the tokenizer's own ids. distillax's byte tokenizer has no files, so its Hugging
Face equivalent is written: a byte-level BPE without merges whose ids are ByteTokenizer's
exactly (pad 0, eos 1, bos 2, byte b at b + 3), BOS added like the data pipeline adds it, and
`split_special_tokens` so that text spelling "<s>" is bytes, as ByteTokenizer reads it. It has
no chat template (the byte tokenizer has none). A SentencePiece model file is copied as
tokenizer.model; transformers needs a tokenizer class for it that distillax cannot know.
Every file gets mode 0644 (safetensors writes 0600).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from distillax.data.cross_tokenizer.token_bytes import byte_level_alphabet
from distillax.data.tokenizer import (ByteTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer,
                                      Tokenizer)

FILE_MODE = 0o644
# What transformers reads from a tokenizer folder (copied when the source folder has them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "added_tokens.json",
                   "tokenizer.model", "generation_config.json")
BYTE_SPECIALS = {"<pad>": ByteTokenizer.pad_id, "</s>": ByteTokenizer.eos_id,
                 "<s>": ByteTokenizer.bos_id}


def byte_tokenizer_json() -> str:
  """tokenizer.json of the byte tokenizer: the same ids for every text, decoded the same way."""
  from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models
  from tokenizers import pre_tokenizers, processors
  vocab = dict(BYTE_SPECIALS)
  vocab.update({char: b + ByteTokenizer.NUM_SPECIALS for b, char in byte_level_alphabet().items()})
  tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIALS])
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", ByteTokenizer.bos_id)])
  return tok.to_str(pretty=True)


def _token(tokenizer: Tokenizer, token_id: int | None) -> str | None:
  if token_id is None:
    return None
  if isinstance(tokenizer, HuggingFaceTokenizer):
    return tokenizer._tok.id_to_token(int(token_id))  # noqa: SLF001 - the tokenizers object
  return {v: k for k, v in BYTE_SPECIALS.items()}.get(int(token_id))


def tokenizer_config(tokenizer: Tokenizer, max_len: int) -> dict:
  """A tokenizer_config.json for a folder that has none: the fast tokenizer class and the
  special tokens distillax uses."""
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(max_len),
            "clean_up_tokenization_spaces": False}
  for name, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                         ("pad_token", tokenizer.pad_id)):
    token = _token(tokenizer, token_id)
    if token is not None:
      config[name] = token
  if isinstance(tokenizer, ByteTokenizer):
    config["split_special_tokens"] = True
  return config


def generation_config(tokenizer: Tokenizer) -> dict:
  """generation_config.json: the ids `generate` starts, stops and pads with."""
  config = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
            "pad_token_id": tokenizer.pad_id}
  return {k: v for k, v in config.items() if v is not None}


def write_tokenizer_files(tokenizer: Tokenizer, path: str | os.PathLike, *, max_len: int,
                          chat_template: str | None = None) -> None:
  """Writes (or copies) the tokenizer, its chat template and generation_config.json into
  `path`. max_len: the model's max_seq_len (the tokenizer's model_max_length); chat_template:
  the template the model was trained with when it is not the tokenizer's own (a
  data.chat_template file), written as chat_template.jinja, which transformers reads first."""
  path = Path(path)
  if isinstance(tokenizer, HuggingFaceTokenizer):
    folder = Path(tokenizer.path).parent
    shutil.copyfile(tokenizer.path, path / "tokenizer.json")
    for name in TOKENIZER_FILES[1:]:
      if (folder / name).is_file():
        shutil.copyfile(folder / name, path / name)
  elif isinstance(tokenizer, ByteTokenizer):
    (path / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
  elif isinstance(tokenizer, SentencePieceTokenizer):
    shutil.copyfile(tokenizer.model_path, path / "tokenizer.model")
  if isinstance(tokenizer, (HuggingFaceTokenizer, ByteTokenizer)):
    if not (path / "tokenizer_config.json").is_file():
      _write_json(path / "tokenizer_config.json", tokenizer_config(tokenizer, max_len))
  if not (path / "generation_config.json").is_file():
    _write_json(path / "generation_config.json", generation_config(tokenizer))
  if chat_template is not None:
    (path / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def _write_json(file: Path, value: dict) -> None:
  file.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def make_readable(path: str | os.PathLike) -> None:
  """Mode 0644 on every file directly in `path`: an export is meant to be shared."""
  for file in Path(path).iterdir():
    if file.is_file():
      os.chmod(file, FILE_MODE)
