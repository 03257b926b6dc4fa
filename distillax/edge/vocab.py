"""Tokenizers as llama.cpp vocabularies, so llama.cpp turns text into the ids distillax does.

  byte (ByteTokenizer)     llama.cpp's SPM type ('llama') holding only byte tokens: ids 0/1/2
                           are <pad>/</s>/<s>, id 3 + b is byte b, the padding rows up to the
                           model's vocab are unused tokens. llama.cpp's SPM tokenizer always
                           writes spaces as U+2581 before looking pieces up, so byte 0x20 is the
                           piece '▁' (not '<0x20>'); every other byte is '<0xXX>' and reached by
                           byte fallback. One text differs: a literal U+2581 in the input is read
                           as a space by llama.cpp (distillax: its three UTF-8 bytes).
  hf:tokenizer.json (BPE)  byte-level BPE (GPT-2, Llama 3, Qwen 2 style) as llama.cpp's 'gpt2'
                           type: the vocabulary, the merges and the pre-tokenizer named by its
                           split pattern (gpt-2, llama-bpe, qwen2); added special tokens are
                           control tokens.

Other tokenizers (SentencePiece models, SentencePiece-style tokenizer.json) are refused with a
UserError rather than written approximately: a GGUF that tokenizes differently would make every
figure measured in llama.cpp wrong without saying so.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from distillax.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, Tokenizer
from distillax.errors import UserError

# gguf.TokenType, spelled out so this module does not need the edge extra to import.
NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6

# tokenizer.json split patterns -> (llama.cpp pre-tokenizer, whether llama.cpp ignores merges
# for whole-word tokens with it; the tokenizer.json must say the same).
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_SPLIT_PATTERNS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": ("llama-bpe", True),
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": ("qwen2", False),
    _GPT2_PATTERN: ("gpt-2", False),
}


@dataclasses.dataclass
class GGUFVocab:
  """What a GGUF file says about its tokenizer (the `tokenizer.ggml.*` keys)."""

  model: str  # 'llama' (SentencePiece) | 'gpt2' (byte-level BPE)
  tokens: list[str]
  types: list[int]
  bos_id: int | None
  eos_id: int | None
  pad_id: int | None
  scores: list[float] | None = None
  merges: list[str] | None = None
  pre: str | None = None

  def write(self, writer, add_bos: bool) -> None:
    """Adds the vocabulary to a gguf.GGUFWriter. `add_bos`: whether llama.cpp prepends BOS when
    asked to add special tokens (distillax's data.add_bos)."""
    writer.add_tokenizer_model(self.model)
    if self.pre is not None:
      writer.add_tokenizer_pre(self.pre)
    writer.add_token_list(self.tokens)
    writer.add_token_types(self.types)
    if self.scores is not None:
      writer.add_token_scores(self.scores)
    if self.merges is not None:
      writer.add_token_merges(self.merges)
    for name, token_id in (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id)):
      if token_id is not None:
        getattr(writer, f"add_{name}_token_id")(token_id)
    writer.add_add_bos_token(bool(add_bos and self.bos_id is not None))
    writer.add_add_eos_token(False)
    if self.model == "llama":
      writer.add_add_space_prefix(False)


def vocab_of(tokenizer: Tokenizer, vocab_size: int) -> GGUFVocab:
  """The GGUF vocabulary of a distillax tokenizer, padded with unused tokens to the model's
  `vocab_size` (llama.cpp's vocabulary is the embedding's row count)."""
  if tokenizer.vocab_size > vocab_size:
    raise UserError(f"the tokenizer emits {tokenizer.vocab_size} ids but the model's vocab_size "
                    f"is {vocab_size}; export with the tokenizer the model was trained with")
  if isinstance(tokenizer, ByteTokenizer):
    return _byte_vocab(tokenizer, vocab_size)
  if isinstance(tokenizer, HuggingFaceTokenizer):
    return _hf_bpe_vocab(tokenizer, vocab_size)
  raise UserError(f"GGUF export supports the byte tokenizer and byte-level BPE tokenizer.json "
                  f"files, not {tokenizer!r}; train with data.tokenizer='byte' or "
                  f"'hf:<tokenizer.json>'")


def _byte_vocab(tokenizer: ByteTokenizer, vocab_size: int) -> GGUFVocab:
  specials = {tokenizer.pad_id: "<pad>", tokenizer.eos_id: "</s>", tokenizer.bos_id: "<s>"}
  tokens, types = [], []
  for i in range(vocab_size):
    byte = i - tokenizer.NUM_SPECIALS
    if i in specials:
      tokens.append(specials[i])
      types.append(CONTROL)
    elif 0 <= byte < 256:
      tokens.append("\u2581" if byte == 0x20 else f"<0x{byte:02X}>")
      types.append(NORMAL if byte == 0x20 else BYTE)
    else:
      tokens.append(f"<unused{i}>")
      types.append(UNUSED)
  return GGUFVocab("llama", tokens, types, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id,
                   scores=[0.0] * vocab_size)


def _read_tokenizer_json(path: str) -> dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f"{path} is not a readable tokenizer.json ({e}); point data.tokenizer at "
                    f"the tokenizer.json of a Hugging Face model") from None


def _pre_tokenizers(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
  if not spec:
    return []
  if spec.get("type") == "Sequence":
    return [p for s in spec.get("pretokenizers", []) for p in _pre_tokenizers(s)]
  return [spec]


def _llama_cpp_pre(spec: dict[str, Any], where: str) -> tuple[str, bool]:
  """llama.cpp's pre-tokenizer for a byte-level tokenizer.json, and its ignore_merges."""
  parts = _pre_tokenizers(spec.get("pre_tokenizer"))
  byte_level = [p for p in parts if p.get("type") == "ByteLevel"]
  splits = [p for p in parts if p.get("type") == "Split"]
  if not byte_level or any(p.get("add_prefix_space") for p in byte_level):
    raise UserError(f"{where}: only byte-level BPE tokenizers without add_prefix_space map to "
                    f"llama.cpp's gpt2 type; this pre_tokenizer is {parts}")
  if splits:
    pattern = (splits[0].get("pattern") or {}).get("Regex")
  else:
    pattern = _GPT2_PATTERN if byte_level[0].get("use_regex", True) else None
  if len(splits) > 1 or pattern not in _SPLIT_PATTERNS:
    raise UserError(f"{where}: the pre-tokenizer split {pattern!r} has no llama.cpp equivalent "
                    f"distillax knows (GPT-2, Llama 3 and Qwen 2 patterns)")
  return _SPLIT_PATTERNS[pattern]


def _hf_bpe_vocab(tokenizer: HuggingFaceTokenizer, vocab_size: int) -> GGUFVocab:
  where = tokenizer.path
  spec = _read_tokenizer_json(where)
  model = spec.get("model") or {}
  if model.get("type") != "BPE" or model.get("byte_fallback"):
    raise UserError(f"{where}: a {model.get('type')} tokenizer"
                    f"{' with byte_fallback' if model.get('byte_fallback') else ''} is not "
                    f"byte-level BPE; GGUF export writes only byte-level BPE tokenizer.json files")
  pre, ignores_merges = _llama_cpp_pre(spec, where)
  if bool(model.get("ignore_merges")) != ignores_merges:
    raise UserError(f"{where}: ignore_merges={bool(model.get('ignore_merges'))} but llama.cpp's "
                    f"{pre} pre-tokenizer uses {ignores_merges}; the two would tokenize apart")
  by_id = {int(i): token for token, i in model["vocab"].items()}
  kinds = {}
  for added in spec.get("added_tokens") or []:
    by_id[int(added["id"])] = added["content"]
    kinds[int(added["id"])] = CONTROL if added.get("special") else USER_DEFINED
  tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
  types = [kinds.get(i, NORMAL if i in by_id else UNUSED) for i in range(vocab_size)]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
  return GGUFVocab("gpt2", tokens, types, tokenizer.bos_id, tokenizer.eos_id,
                   tokenizer.pad_id if tokenizer.pad_id in kinds else None, merges=merges, pre=pre)
