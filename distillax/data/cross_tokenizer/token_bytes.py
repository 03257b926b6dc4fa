"""The bytes behind tokens: what byte string each id spells, and where each token of an encoding
lies in the UTF-8 bytes of the text.

Two tokenizers of one text can only be compared through the text itself, and bytes are the one
unit both share: a byte-level BPE cuts a multi-byte character ("日" is 3 bytes) into pieces that
character offsets cannot tell apart (`tokenizers` reports every piece with the whole character's
span). `encode_with_byte_offsets` gives each piece its own bytes, laid out by the byte length of
the piece's vocabulary entry. `token_byte_strings` spells every id as bytes (byte-level BPE's
printable alphabet undone, SentencePiece's "▁" as a space, "<0xHH>" byte-fallback pieces as the
byte), so that `shared_vocab` can map ids between two vocabularies: same bytes, same token.
Special tokens are spelled by their text ("</s>"), so two tokenizers that spell EOS alike share it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import numpy as np

from distillax.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, Tokenizer
from distillax.errors import ConfigError

# ByteTokenizer's specials, spelled as its Hugging Face export spells them.
BYTE_SPECIALS = {ByteTokenizer.pad_id: "<pad>", ByteTokenizer.eos_id: "</s>",
                 ByteTokenizer.bos_id: "<s>"}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[int, str]:
  """GPT-2's printable character for each byte: what the ByteLevel pre-tokenizer emits."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


def _mentions_byte_level(node) -> bool:
  if isinstance(node, dict):
    return node.get("type") == "ByteLevel" or any(_mentions_byte_level(v) for v in node.values())
  if isinstance(node, list):
    return any(_mentions_byte_level(v) for v in node)
  return False


def _hf_byte_strings(tokenizer: HuggingFaceTokenizer) -> list[bytes | None]:
  backend = tokenizer.backend
  spec = json.loads(backend.to_str())
  byte_level = _mentions_byte_level([spec.get("pre_tokenizer"), spec.get("decoder")])
  unbyte = {c: b for b, c in byte_level_alphabet().items()}
  added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
  out = []
  for token_id in range(tokenizer.vocab_size):
    piece = backend.id_to_token(token_id)
    if token_id in added or piece is None:
      out.append(added[token_id].encode() if token_id in added else None)
    elif byte_level and all(c in unbyte for c in piece):
      out.append(bytes(unbyte[c] for c in piece))
    elif fallback := _BYTE_FALLBACK.fullmatch(piece):
      out.append(bytes([int(fallback.group(1), 16)]))
    else:
      out.append(piece.replace("▁", " ").encode())
  return out


@functools.lru_cache(maxsize=8)
def token_byte_strings(tokenizer: Tokenizer) -> tuple[bytes | None, ...]:
  """The byte string of every id in [0, vocab_size) (None for an id that spells nothing); kept
  per tokenizer object, as spelling a 262k vocabulary takes a fraction of a second."""
  return tuple(_byte_strings(tokenizer))


def _byte_strings(tokenizer: Tokenizer) -> list[bytes | None]:
  if isinstance(tokenizer, ByteTokenizer):
    return [BYTE_SPECIALS[i].encode() if i in BYTE_SPECIALS else bytes([i - tokenizer.NUM_SPECIALS])
            for i in range(tokenizer.vocab_size)]
  if isinstance(tokenizer, HuggingFaceTokenizer):
    return _hf_byte_strings(tokenizer)
  raise ConfigError(f"{tokenizer!r} cannot spell its tokens as bytes, which a cross-tokenizer "
                    "teacher needs; use a 'hf:<tokenizer.json>' or 'byte' tokenizer")


def byte_offsets(text: str, char_offsets_Nx2: np.ndarray, piece_bytes_N: np.ndarray) -> np.ndarray:
  """[start, end) UTF-8 byte offsets [N, 2] from character offsets [N, 2].

  A run of tokens whose character spans overlap (pieces of one character, or a piece fused with
  its neighbour) shares the run's bytes in order, each piece taking its vocabulary length
  (`piece_bytes_N`), the last one what is left; any other token keeps its characters' bytes.
  Tokens with no characters (specials the tokenizer inserted) keep no bytes."""
  widths = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text))
  char_to_byte = np.concatenate([[0], np.cumsum(widths)])
  char_offsets_Nx2 = np.asarray(char_offsets_Nx2, np.int64).reshape(-1, 2)
  start_N, end_N = char_to_byte[char_offsets_Nx2[:, 0]], char_to_byte[char_offsets_Nx2[:, 1]]
  n = len(start_N)
  if n == 0:
    return np.zeros((0, 2), np.int64)
  reach_N = np.maximum.accumulate(end_N)  # the furthest byte any token up to i covers
  joins_N = np.zeros(n, bool)
  joins_N[1:] = (end_N[1:] > start_N[1:]) & (start_N[1:] < reach_N[:-1])
  run_N = np.cumsum(~joins_N) - 1
  run_start = np.minimum.reduceat(start_N, np.flatnonzero(~joins_N))
  run_end = np.maximum.reduceat(end_N, np.flatnonzero(~joins_N))
  lengths_N = np.asarray(piece_bytes_N, np.int64)
  before_N = np.cumsum(lengths_N) - lengths_N
  before_N -= before_N[np.flatnonzero(~joins_N)][run_N]  # bytes taken by earlier pieces of the run
  laid_start_N = np.minimum(run_start[run_N] + before_N, run_end[run_N])
  last_N = np.append(run_N[1:] != run_N[:-1], True)
  laid_end_N = np.where(last_N, run_end[run_N], np.append(laid_start_N[1:], 0))
  in_run_N = joins_N | np.append(joins_N[1:], False)
  return np.stack([np.where(in_run_N, laid_start_N, start_N),
                   np.where(in_run_N, laid_end_N, end_N)], axis=-1)


def encode_with_byte_offsets(tokenizer: Tokenizer, text: str):
  """(int32 ids [N], int64 UTF-8 byte offsets [N, 2]) of `text`."""
  if isinstance(tokenizer, ByteTokenizer):
    ids = tokenizer.encode_array(text)
    starts = np.arange(len(ids), dtype=np.int64)
    return ids, np.stack([starts, starts + 1], axis=-1)
  ids, char_offsets = tokenizer.encode_with_offsets(text)
  byte_strings = token_byte_strings(tokenizer)
  piece_bytes = np.fromiter((len(byte_strings[i] or b"") for i in ids), np.int64, len(ids))
  return ids, byte_offsets(text, char_offsets, piece_bytes)


@dataclasses.dataclass(frozen=True)
class SharedVocab:
  """The ids two vocabularies share (same byte string), as aligned pairs and as a lookup."""
  student_ids_S: np.ndarray        # int32, the student's id of each shared token
  teacher_ids_S: np.ndarray        # int32, the teacher's id of the same token
  teacher_to_student_Vt: np.ndarray  # int32, the student id of each teacher id; -1 if none


def shared_vocab(student: Tokenizer, teacher: Tokenizer) -> SharedVocab:
  """Maps the teacher's ids onto the student's by byte string (built once per pair)."""
  student_id = {}
  for i, spelled in enumerate(token_byte_strings(student)):
    if spelled is not None:
      student_id.setdefault(spelled, i)
  to_student = np.full(teacher.vocab_size, -1, np.int32)
  for i, spelled in enumerate(token_byte_strings(teacher)):
    match = student_id.pop(spelled, None) if spelled is not None else None
    if match is not None:  # popped: each student id pairs with one teacher id at most
      to_student[i] = match
  teacher_ids = np.flatnonzero(to_student >= 0).astype(np.int32)
  return SharedVocab(to_student[teacher_ids], teacher_ids, to_student)
