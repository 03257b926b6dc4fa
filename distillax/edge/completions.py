"""What `distillax eval` asks of a GGUF file in llama.cpp itself: greedy completions of text
prompts, and the logits of the eval tokens.

`distillax eval --model student.gguf --generate held_out.jsonl` scores what the deployed file
writes: each prompt is tokenized by llama.cpp from the file's own vocabulary (BOS as the file
asks), continued greedily by llama.cpp's incremental decode (KV cache) for up to
max_new_tokens tokens or to the file's EOS, and detokenized by llama.cpp. As distillax's sampler
does, the argmax never picks the file's unused rows (a vocabulary padded past the tokenizer's
ids), so an f32 export completes every prompt as the run it came from does.

`segment_logits` gives llama.cpp's logits over each packed eval document from position 0
(edge/measurements.segments), for `eval --model FILE.gguf --against RUN`; `shape` names the
file's dimensions for the same-shape check.

The judge's settings run by default: llama.cpp's portable CPU kernels ("reference", forced on
every CPU) and a float32 KV cache (see gguf_runtime); `describe` names them for the line the
command prints.
"""

from __future__ import annotations

import os
from typing import Sequence

from distillax.edge import runtime as gguf_runtime
from distillax.errors import UserError

KERNELS, EXACT_CACHE = "reference", True


def is_gguf(path: str | None) -> bool:
  """Whether --model names a GGUF file rather than a run or a Hugging Face directory."""
  return bool(path) and str(path).endswith(".gguf")


def describe() -> str:
  return (f"llama.cpp ({KERNELS} kernels, {'f32' if EXACT_CACHE else 'f16'} KV cache), "
          f"greedy")


def _token_limit(llm) -> int:
  """One past the last id that is a token (the rows after it are the padding's unused ones)."""
  import llama_cpp
  vocab = llama_cpp.llama_model_get_vocab(llm.model)
  unused = llama_cpp.LLAMA_TOKEN_ATTR_UNUSED
  limit = llm.n_vocab()
  while limit > 1 and llama_cpp.llama_vocab_get_attr(vocab, limit - 1) & unused:
    limit -= 1
  return limit


def greedy_texts(path: str, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
  """Each prompt's greedy continuation in llama.cpp, as text, cut before EOS."""
  if not os.path.isfile(path):
    raise UserError(f"--model {path}: no such GGUF file")
  llm = gguf_runtime.load(path, kernels=KERNELS, exact_cache=EXACT_CACHE)
  try:
    import llama_cpp
    context = llama_cpp.llama_model_n_ctx_train(llm.model)  # max_seq_len: distillax cuts there
    room = context - max_new_tokens
    if room < 1:
      raise UserError(f"--max_new_tokens={max_new_tokens} leaves no room for a prompt in "
                      f"{path}'s context of {context} tokens; lower it")
    eos, limit, texts = llm.token_eos(), _token_limit(llm), []
    for prompt in prompts:
      ids = gguf_runtime.tokenize(llm, prompt, add_bos=True)[-room:]
      out = gguf_runtime.greedy(llm, ids, max_new_tokens, vocab_limit=limit, stop_id=eos)
      out = out[:out.index(eos)] if eos in out else out
      texts.append(llm.detokenize(out).decode("utf-8", errors="replace"))
    return texts
  finally:
    llm.close()


def shape(llm) -> dict[str, int]:
  """The file's model dimensions by distillax's field names (model.vocab_size, ...)."""
  import llama_cpp
  model = llm.model
  return {"vocab_size": int(llm.n_vocab()), "embed_dim": llama_cpp.llama_model_n_embd(model),
          "num_layers": llama_cpp.llama_model_n_layer(model),
          "num_heads": llama_cpp.llama_model_n_head(model),
          "num_kv_heads": llama_cpp.llama_model_n_head_kv(model)}


def segment_logits(path: str, inputs: Sequence[Sequence[int]], check=None) -> list:
  """llama.cpp's float32 logits (len, vocab) of each id sequence, each evaluated from position
  0; `check(shape(llm))` runs once the file is loaded, before any is evaluated."""
  if not os.path.isfile(path):
    raise UserError(f"--model {path}: no such GGUF file")
  llm = gguf_runtime.load(path, kernels=KERNELS, exact_cache=EXACT_CACHE)
  try:
    if check is not None:
      check(shape(llm))
    return [gguf_runtime.logits(llm, ids) for ids in inputs]
  finally:
    llm.close()
