"""Pieces the GGUF / llama.cpp tests share: tiny configs of every exported architecture,
distillax's forward and greedy decode with llama.cpp's GELU, GGUF metadata reads. Their models
are tests.support.models' PEAKED random models (a clear next token for greedy decoding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from distillax.data import make_eval_iterator, make_tokenizer
from distillax.models.presets import get_preset
from tests.support.models import logits as batch_logits

VOCAB = 384  # the byte tokenizer's 259 ids padded to a multiple of 128, as training pads them
CONFIGS = {
    # Llama with Llama 3.1 RoPE scaling that reaches the test's positions (rope_freqs factors).
    "llama": get_preset("tiny", vocab_size=VOCAB, rope_scaling_factor=8.0,
                        rope_original_max_len=32),
    # Every Gemma 2 feature; the sliding window (8) is shorter than the test sequences.
    "gemma2": get_preset("tiny_gemma", vocab_size=VOCAB),
    "gemma": get_preset("tiny_gemma", vocab_size=VOCAB, use_post_norms=False,
                        attn_logit_softcap=None, final_logit_softcap=None,
                        query_pre_attn_scalar=None, sliding_window=None),
    "qwen2": get_preset("tiny", vocab_size=VOCAB, qkv_bias=True),
    "qwen3": get_preset("tiny", vocab_size=VOCAB, qk_norm=True, tie_embeddings=True),
}
IDS = [int(i) for i in np.random.default_rng(0).integers(3, 259, 40)]  # longer than the window


def table_gelu(real_gelu):
  """llama.cpp's CPU GeGLU (ggml-cpu vec.h, GGML_GELU_FP16): the gate rounded to fp16, GELU
  read from a table of fp16 results, identity above 10 and zero below -10."""
  def gelu(x, approximate=True):
    del approximate  # llama.cpp's table holds the tanh form, Gemma's GELU
    x16 = x.astype(jnp.float16).astype(jnp.float32)
    y = real_gelu(x16, approximate=True).astype(jnp.float16).astype(jnp.float32)
    return jnp.where(x <= -10, 0.0, jnp.where(x >= 10, x, y)).astype(x.dtype)
  return gelu


LLAMA_CPP_GELU = table_gelu(jax.nn.gelu)


def logits(model, ids, llama_cpp_gelu: bool = False) -> np.ndarray:
  """distillax's float32 logits (len(ids), vocab) of one sequence, under jit; `llama_cpp_gelu`
  evaluates GELU as llama.cpp's CPU GeGLU does (see `table_gelu`)."""
  gelu = LLAMA_CPP_GELU if llama_cpp_gelu else None
  return np.asarray(batch_logits(model, [list(ids)], gelu)[0])


def greedy(model, prompt, max_new_tokens: int, llama_cpp_gelu: bool = False
           ) -> tuple[list[int], float]:
  """distillax's greedy continuation (one full causal forward per token over a fixed-length
  buffer: later slots cannot change earlier logits) and the smallest top-1 margin it met."""
  gelu = LLAMA_CPP_GELU if llama_cpp_gelu else None
  buffer = np.zeros((1, len(prompt) + max_new_tokens), np.int32)
  buffer[0, :len(prompt)] = prompt
  margin = np.inf
  for t in range(len(prompt), buffer.shape[1]):
    row = np.asarray(batch_logits(model, buffer, gelu)[0, t - 1])
    top2 = np.sort(row)[-2:]
    margin = min(margin, float(top2[1] - top2[0]))
    buffer[0, t] = int(np.argmax(row))
  return buffer[0, len(prompt):].tolist(), margin


def field(reader, key: str):
  """The value of a GGUF key as Python values (gguf's ReaderField.contents)."""
  return reader.fields[key].contents()


def byte_eval_batches(num_batches: int = 2) -> list[dict[str, np.ndarray]]:
  """Packed eval batches of the embedded corpus under the byte tokenizer (8 x 32 tokens), the
  demo's batch layout at test size: what the llama.cpp measuring tests read."""
  return list(make_eval_iterator({"tokenizer": "byte"}, global_batch_size=8, seq_len=32,
                                 num_batches=num_batches, tokenizer=make_tokenizer("byte")))
