"""Pieces the GGUF / llama.cpp tests share: tiny configs of every exported architecture, a model
with peaked next-token logits, distillax's forward and greedy decode, GGUF metadata reads."""

from __future__ import annotations

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax.data import make_eval_iterator, make_tokenizer
from distillax.models.config import get_preset
from distillax.models.init import abstract_model

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


def peaked_model(config, seed: int = 0, logit_gain: float = 1.5):
  """A model whose next token is clear, so greedy decoding never meets a near-tie: embeddings
  of unit variance carry the residual stream (the blocks, initialised at 0.5 / sqrt(fan_in),
  perturb it), and each output row is the normalised embedding of the token it should follow
  under a fixed random permutation (tied models: the token itself). Norm scales and biases are
  drawn away from their init so their tensors are checked too."""
  graphdef, state = nnx.split(abstract_model(config))
  rng = np.random.default_rng(seed)
  values = {}
  for path, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if name.endswith("norm/scale"):
      base = 0.0 if config.norm_scale_plus_one else 1.0
      value = base + 0.1 * rng.normal(size=x.shape)
    elif name.endswith("_bias"):
      value = 0.1 * rng.normal(size=x.shape)
    elif name == "embedder/embedding":
      value = rng.normal(size=x.shape) / (np.sqrt(config.embed_dim) if config.scale_embeddings
                                          else 1.0)
    elif name == "lm_head":
      continue
    else:
      fan_in = x.shape[0] * x.shape[1] if name.endswith("attn/o") else x.shape[0]
      value = 0.5 * rng.normal(size=x.shape) / np.sqrt(fan_in)
    values[name] = value
  if not config.tie_embeddings:
    unit = values["embedder/embedding"] / np.linalg.norm(values["embedder/embedding"], axis=1,
                                                         keepdims=True)
    successor = rng.permutation(config.vocab_size)
    head = np.zeros((config.embed_dim, config.vocab_size))
    head[:, successor] = unit.T * logit_gain
    values["lm_head"] = head

  def put(path, x):
    return jnp.asarray(values["/".join(str(getattr(k, "key", k)) for k in path)], x.dtype)

  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(put, nnx.to_pure_dict(state)))
  return nnx.merge(graphdef, state)


def logits(model, ids, llama_cpp_gelu: bool = False) -> np.ndarray:
  """distillax's float32 logits (len(ids), vocab) of one sequence, under jit; `llama_cpp_gelu`
  evaluates GELU as llama.cpp's CPU GeGLU does (see `table_gelu`)."""
  graphdef, state = nnx.split(model)
  fn = _logits_table_gelu if llama_cpp_gelu else _logits
  return np.asarray(fn(graphdef, state, jnp.asarray([list(ids)], jnp.int32))[0])


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, tokens_BxL):
  return nnx.merge(graphdef, state)(tokens_BxL).logits_BxLxV


@functools.partial(jax.jit, static_argnums=0)
def _logits_table_gelu(graphdef, state, tokens_BxL):
  with mock.patch.object(jax.nn, "gelu", table_gelu(jax.nn.gelu)):  # at trace time
    return nnx.merge(graphdef, state)(tokens_BxL).logits_BxLxV


def table_gelu(real_gelu):
  """llama.cpp's CPU GeGLU (ggml-cpu vec.h, GGML_GELU_FP16): the gate rounded to fp16, GELU
  read from a table of fp16 results, identity above 10 and zero below -10."""
  def gelu(x, approximate=True):
    del approximate  # llama.cpp's table holds the tanh form, Gemma's GELU
    x16 = x.astype(jnp.float16).astype(jnp.float32)
    y = real_gelu(x16, approximate=True).astype(jnp.float16).astype(jnp.float32)
    return jnp.where(x <= -10, 0.0, jnp.where(x >= 10, x, y)).astype(x.dtype)
  return gelu


def greedy(model, prompt, max_new_tokens: int, llama_cpp_gelu: bool = False
           ) -> tuple[list[int], float]:
  """distillax's greedy continuation (one full causal forward per token over a fixed-length
  buffer: later slots cannot change earlier logits) and the smallest top-1 margin it met."""
  graphdef, state = nnx.split(model)
  fn = _logits_table_gelu if llama_cpp_gelu else _logits
  buffer = np.zeros((1, len(prompt) + max_new_tokens), np.int32)
  buffer[0, :len(prompt)] = prompt
  margin = np.inf
  for t in range(len(prompt), buffer.shape[1]):
    row = np.asarray(fn(graphdef, state, jnp.asarray(buffer))[0, t - 1])
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
