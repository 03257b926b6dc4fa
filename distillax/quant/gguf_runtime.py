"""Running an exported GGUF in llama.cpp (llama-cpp-python, the `edge` extra) for measurements.

  llm = gguf_runtime.load("student-q4_0.gguf")
  logits_LxV = gguf_runtime.logits(llm, ids)       # llama.cpp's own forward, every position
  ids_out = gguf_runtime.greedy(llm, prompt, 32)   # its incremental decode (KV cache), argmax

Two settings differ from llama.cpp's defaults, each for a measured reason:
  - the KV cache is float32 (`exact_cache=True`; llama.cpp's default is float16), so comparing
    logits with distillax's forward measures the weights' and activations' rounding, not the
    cache's; pass exact_cache=False to measure the deployment default.
  - on CPUs with AMX (Sapphire Rapids and later) llama.cpp's "extra buffer types" are turned off:
    its AMX matmul for q8_0 / q4_0 crashes in llama.cpp 0.3.36's build (SIGSEGV in
    ggml_backend_amx_mul_mat, upstream llama.cpp issue 20824; issue/PR 16315 reports wrong q4_0
    results). llama.cpp then runs its portable CPU kernels, whose rounding quant/ggml.py models.
"""

from __future__ import annotations

import contextlib
import os
from typing import Sequence

import numpy as np

from distillax.errors import UserError

GGML_TYPE_F32 = 0


def _llama_cpp():
  try:
    import llama_cpp
  except ImportError as e:
    raise UserError("running a GGUF needs llama-cpp-python; install the edge extra: pip install "
                    "'distillax[edge]' (it builds llama.cpp from source)") from e
  return llama_cpp


def has_amx() -> bool:
  """Whether this llama.cpp build uses AMX matmuls on this CPU."""
  return b"AMX_INT8 = 1" in _llama_cpp().llama_print_system_info()


@contextlib.contextmanager
def _model_params(use_extra_bufts: bool):
  """llama_cpp.Llama builds its model params from llama_model_default_params() and offers no
  argument for use_extra_bufts, so the default is patched while a model loads."""
  low_level = _llama_cpp().llama.llama_cpp
  default = low_level.llama_model_default_params

  def params():
    p = default()
    p.use_extra_bufts = use_extra_bufts
    return p

  low_level.llama_model_default_params = params
  try:
    yield
  finally:
    low_level.llama_model_default_params = default


def load(path: str | os.PathLike, *, n_ctx: int = 0, exact_cache: bool = True,
         n_threads: int | None = None):
  """A llama_cpp.Llama for `path` that keeps every position's logits. n_ctx 0: the file's
  context_length."""
  llama_cpp = _llama_cpp()
  if not os.path.isfile(path):
    raise UserError(f"{path}: no such GGUF file")
  cache = dict(type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32) if exact_cache else {}
  with _model_params(use_extra_bufts=not has_amx()):
    return llama_cpp.Llama(model_path=os.fspath(path), logits_all=True, n_ctx=n_ctx,
                           n_threads=n_threads, n_threads_batch=n_threads, verbose=False,
                           **cache)


def logits(llm, ids: Sequence[int]) -> np.ndarray:
  """llama.cpp's float32 logits (len(ids), vocab) for `ids` evaluated from position 0."""
  llm.reset()
  llm.eval([int(i) for i in ids])
  return np.array(llm.scores[:len(ids)], dtype=np.float32)


def greedy(llm, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
  """Greedy continuation in llama.cpp: the prompt once, then one token per decode step."""
  llm.reset()
  llm.eval([int(i) for i in prompt])
  out = []
  for _ in range(max_new_tokens):
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    out.append(token)
    llm.eval([token])
  return out


def tokenize(llm, text: str, add_bos: bool = False) -> list[int]:
  """llama.cpp's ids for `text` (special-token text is not parsed)."""
  return list(llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False))
