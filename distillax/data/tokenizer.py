"""Tokenizers behind one small interface: byte-level (no files), SentencePiece, Hugging Face.

Every tokenizer has `encode(str) -> list[int]`, `decode(list[int]) -> str`, `vocab_size` (the
number of ids it can emit), `pad_id` (always an int: padding is masked out of the loss, so any id
is safe; tokenizers without one use 0), and `bos_id` / `eos_id` (int or None). `encode_array`
returns the ids as an int32 numpy array, which is what the grain pipeline packs.

Tokenizers are built from a spec string: 'byte', 'spm:<model file>' or 'hf:<tokenizer.json>'
(or 'hf:<folder holding tokenizer.json>'). The file-backed ones reload from their path when copied
into a grain worker process, so nothing but the path crosses the process boundary.

Chat data (distillax.data.chat) needs two more things, which 'byte' and 'hf:' have:
`encode_with_offsets(text)` (ids plus each id's [start, end) characters, to map trained
character spans onto tokens) and, for 'hf:', what transformers reads next to tokenizer.json:
`chat_template` (chat_template.jinja, else tokenizer_config.json's "chat_template"),
`special_tokens_map` (bos_token, eos_token, ... as strings: the template's variables) and
`control_tokens` (the special added tokens, e.g. an end-of-turn token).
"""

from __future__ import annotations

import json
import os

import numpy as np

from distillax.errors import ConfigError, UserError


class Tokenizer:
  """The interface the data pipeline and the samplers code against."""

  vocab_size: int
  pad_id: int
  bos_id: int | None
  eos_id: int | None

  def encode(self, text: str) -> list[int]:
    raise NotImplementedError

  def decode(self, ids) -> str:
    raise NotImplementedError

  def encode_array(self, text: str) -> np.ndarray:
    return np.asarray(self.encode(text), dtype=np.int32)

  # Chat support (see the module doc); a tokenizer without offsets cannot mask chat tokens.
  chat_template: str | None = None
  special_tokens_map: dict[str, str] = {}
  control_tokens: tuple[str, ...] = ()

  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids [N], int64 character offsets [N, 2]) of `text`."""
    raise ConfigError(
        f"{self!r} reports no character offsets, which chat and prompt/completion records need "
        "to mask prompt tokens; use data.tokenizer='hf:<tokenizer.json>' (or 'byte')")


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes shifted past three specials (ByT5's layout): pad=0, eos=1, bos=2, byte b=b+3.

  vocab_size is 259; use `padded_vocab_size` for a model embedding that shards evenly.
  """

  NUM_SPECIALS = 3
  vocab_size = 256 + NUM_SPECIALS
  pad_id = 0
  eos_id = 1
  bos_id = 2

  def encode(self, text: str) -> list[int]:
    return self.encode_array(text).tolist()

  def encode_array(self, text: str) -> np.ndarray:
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return raw.astype(np.int32) + self.NUM_SPECIALS

  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Every byte of character c spans [c, c + 1)."""
    widths = np.array([len(c.encode("utf-8")) for c in text], dtype=np.int64)
    starts = np.repeat(np.arange(len(text), dtype=np.int64), widths)
    return self.encode_array(text), np.stack([starts, starts + 1], axis=-1).reshape(-1, 2)

  def decode(self, ids) -> str:
    ids_N = np.asarray(ids, dtype=np.int64).reshape(-1)
    # Specials and ids past the byte range (a model with a padded vocab may emit them) are dropped.
    ids_N = ids_N[(ids_N >= self.NUM_SPECIALS) & (ids_N < self.vocab_size)]
    return (ids_N - self.NUM_SPECIALS).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def __repr__(self):
    return "ByteTokenizer()"


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece `.model` file (needs the `spm` extra: pip install 'distillax[spm]')."""

  def __init__(self, model_path: str):
    self.model_path = os.fspath(model_path)
    self._load()

  def _load(self):
    try:
      import sentencepiece
    except ImportError as e:
      raise ConfigError(
          f"tokenizer 'spm:{self.model_path}' needs the sentencepiece package; "
          "install it with pip install 'distillax[spm]'") from e
    self._sp = sentencepiece.SentencePieceProcessor()
    try:
      self._sp.Load(self.model_path)
    except (OSError, RuntimeError) as e:
      raise UserError(
          f"tokenizer 'spm:{self.model_path}' is not a readable SentencePiece model file ({e}); "
          "point data.tokenizer at a .model file written by SentencePieceTrainer") from e
    self.vocab_size = int(self._sp.GetPieceSize())
    self.pad_id = _id_or_none(self._sp.pad_id())
    self.bos_id = _id_or_none(self._sp.bos_id())
    self.eos_id = _id_or_none(self._sp.eos_id())
    if self.pad_id is None:
      self.pad_id = 0

  def encode(self, text: str) -> list[int]:
    return list(self._sp.EncodeAsIds(text))

  def decode(self, ids) -> str:
    return self._sp.DecodeIds([int(i) for i in np.asarray(ids).reshape(-1)])

  def __getstate__(self):  # grain workers get a copy: send the path, not the C++ object
    return {"model_path": self.model_path}

  def __setstate__(self, state):
    self.model_path = state["model_path"]
    self._load()

  def __repr__(self):
    return f"SentencePieceTokenizer({self.model_path!r})"


# Special tokens recognised in a tokenizer.json, in order of preference.
_HF_PAD = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")
_HF_BOS = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
_HF_EOS = ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "[SEP]")


# The named special tokens transformers passes to a chat template (SPECIAL_TOKENS_ATTRIBUTES).
_HF_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                    "mask_token")


class HuggingFaceTokenizer(Tokenizer):
  """A Hugging Face `tokenizer.json` loaded with the `tokenizers` package.

  BOS/EOS/PAD are those that tokenizer_config.json next to it names (as transformers reads them);
  without that file (or a token it leaves out) they are found by their usual spellings (<s>,
  </s>, <eos>, <|endoftext|>, <pad>, ...). The chat template and the special-token strings come
  from the same folder (see the module doc).
  """

  def __init__(self, path: str):
    self.path = os.fspath(path)
    self._load()

  def _load(self):
    try:
      import tokenizers
    except ImportError as e:
      raise ConfigError(
          f"tokenizer 'hf:{self.path}' needs the tokenizers package; install it with "
          "pip install tokenizers (it comes with the 'hf' extra)") from e
    try:
      self._tok = tokenizers.Tokenizer.from_file(self.path)
    except Exception as e:  # tokenizers raises a bare Exception for unreadable files
      raise UserError(
          f"tokenizer 'hf:{self.path}' is not a readable tokenizer.json ({e}); "
          "point data.tokenizer at the tokenizer.json of a Hugging Face model") from e
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    config, self.chat_template = read_hf_tokenizer_files(os.path.dirname(self.path))
    self.special_tokens_map = _named_tokens(config)
    self.control_tokens = tuple(sorted(
        {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}))
    self.bos_id = self._configured("bos_token", config, _HF_BOS)
    self.eos_id = self._configured("eos_token", config, _HF_EOS)
    pad = self._configured("pad_token", config, _HF_PAD)
    self.pad_id = pad if pad is not None else 0

  @property
  def backend(self):
    """The `tokenizers.Tokenizer` itself: its vocabulary, pre-tokenizer and decoder, for code
    that needs more than ids (the byte spelling of every token, data.token_bytes)."""
    return self._tok

  def unused_specials_from(self, first: int) -> list[str] | None:
    """The tokens with ids >= `first` when every one is a special added token that neither
    names bos/eos/pad nor appears in the chat template (Gemma 3's <image_soft_token>, id
    262,144, a placeholder its processor swaps for image features, one past the 1B's table);
    None otherwise."""
    named = {self.bos_id, self.eos_id, self.pad_id}
    added = self._tok.get_added_tokens_decoder()
    tokens = [added.get(i) for i in range(first, self.vocab_size)]
    if any(t is None or not t.special or i in named or t.content in (self.chat_template or "")
           for i, t in zip(range(first, self.vocab_size), tokens)):
      return None
    return [t.content for t in tokens]

  def _configured(self, name: str, config: dict, candidates) -> int | None:
    """The id of the token tokenizer_config.json names (None when it says null), else a guess."""
    if name in config and config[name] is None:
      return None
    token_id = self._tok.token_to_id(self.special_tokens_map.get(name, ""))
    return int(token_id) if token_id is not None else self._find(candidates)

  def _find(self, candidates) -> int | None:
    for token in candidates:
      token_id = self._tok.token_to_id(token)
      if token_id is not None:
        return int(token_id)
    return None

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    encoding = self._tok.encode(text, add_special_tokens=False)
    return (np.asarray(encoding.ids, dtype=np.int32),
            np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2))

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                            skip_special_tokens=True)

  def __getstate__(self):
    return {"path": self.path}

  def __setstate__(self, state):
    self.path = state["path"]
    self._load()

  def __repr__(self):
    return f"HuggingFaceTokenizer({self.path!r})"


def _id_or_none(token_id: int) -> int | None:
  return int(token_id) if token_id >= 0 else None


def read_hf_tokenizer_files(folder: str) -> tuple[dict, str | None]:
  """(tokenizer_config.json as a dict or {}, the chat template or None) of a tokenizer folder.

  The template is looked up as transformers 5 loads it: chat_template.jinja (what its
  save_pretrained writes) first, else the config's "chat_template" (a string, or a list of
  {name, template} of which "default" is the one used without tools)."""
  config = {}
  config_path = os.path.join(folder, "tokenizer_config.json")
  if os.path.isfile(config_path):
    try:
      with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    except (OSError, ValueError) as e:
      raise UserError(f"{config_path} is not readable JSON ({e}); fix or remove it") from e
    if not isinstance(config, dict):
      raise UserError(f"{config_path} holds no JSON object; fix or remove it")
  jinja_path = os.path.join(folder, "chat_template.jinja")
  if os.path.isfile(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      return config, f.read()
  template = config.get("chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  return config, template if isinstance(template, str) else None


def _named_tokens(config: dict) -> dict[str, str]:
  """The special-token strings transformers hands a chat template (bos_token, eos_token, ... and
  any model-specific ones in "extra_special_tokens"); the config writes each as a string or as an
  AddedToken object with a "content"."""
  extra = config.get("extra_special_tokens")
  given = dict(extra) if isinstance(extra, dict) else {}
  given.update({name: config[name] for name in _HF_NAMED_TOKENS if name in config})
  out = {}
  for name, value in given.items():
    if isinstance(value, dict):
      value = value.get("content")
    if isinstance(value, str):
      out[name] = value
  return out


def make_tokenizer(spec: str) -> Tokenizer:
  """'byte' | 'spm:<model file>' | 'hf:<tokenizer.json or its folder>' -> a Tokenizer."""
  spec = str(spec).strip()
  if spec == "byte":
    return ByteTokenizer()
  kind, sep, path = spec.partition(":")
  if not sep or kind not in ("spm", "hf") or not path:
    raise ConfigError(
        f"data.tokenizer={spec!r} is not a tokenizer spec; use 'byte', 'spm:<path to .model>' "
        "or 'hf:<path to tokenizer.json>'")
  path = os.path.expanduser(path)
  if kind == "hf" and os.path.isdir(path):
    folder, path = path, os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
      raise UserError(f"data.tokenizer={spec!r}: {folder} has no tokenizer.json (a checkpoint "
                      f"saved without its tokenizer?); save the model's tokenizer there "
                      f"(transformers' tokenizer.save_pretrained) or point data.tokenizer at "
                      f"the tokenizer.json it was trained with")
  if not os.path.isfile(path):
    raise UserError(f"data.tokenizer={spec!r}: no such file {path!r}; check the path")
  return SentencePieceTokenizer(path) if kind == "spm" else HuggingFaceTokenizer(path)


def padded_vocab_size(tokenizer: Tokenizer | int, multiple: int = 128) -> int:
  """The tokenizer's vocab rounded up to `multiple`, so a 'vocab' dim shards on any small mesh."""
  size = tokenizer if isinstance(tokenizer, int) else tokenizer.vocab_size
  return -(-int(size) // multiple) * multiple


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Raises ConfigError when the model's embedding cannot hold every id the tokenizer emits.

  A larger model vocab is fine (padded embeddings are common); a smaller one would index past
  the embedding table, unless the ids past it are only special tokens that no text or chat
  template of the model spells (a Hugging Face tokenizer's `unused_specials_from`: Gemma 3's
  262,145-token tokenizer over the 1B's 262,144 rows; llama.cpp's converter drops that token
  too).
  """
  unused = getattr(tokenizer, "unused_specials_from", lambda first: None)
  if int(model_vocab_size) < tokenizer.vocab_size and not unused(int(model_vocab_size)):
    raise ConfigError(
        f"model vocab_size={model_vocab_size} is smaller than the tokenizer's vocabulary "
        f"({tokenizer!r} emits {tokenizer.vocab_size} ids); set the model's vocab_size to at "
        f"least {tokenizer.vocab_size} (e.g. {padded_vocab_size(tokenizer)}) or use the "
        "tokenizer the model was trained with")
