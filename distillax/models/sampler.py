"""KV-cached autoregressive generation: greedy, temperature, top-k, top-p; batched and jitted.

Prompts of different lengths are right-aligned inside the jit (left padding with segment id 0),
so every row's last prompt token sits at the same slot and one prefill plus a `lax.scan` of
single-token steps serves the whole batch with static shapes. Padding never leaks into the
attention (segment ids), and positions count real tokens only, so results match running each
prompt alone. The model may be sharded: its arrays keep their shardings and the activation
constraints of `distillax.partitioning` apply when `mesh` and `rules` are given.

Padded vocabulary: a model's embedding usually has more rows than its tokenizer has ids (the
byte tokenizer's 259 ids are padded to 384 so the vocabulary shards evenly; Qwen has 151,936
rows for 151,669 tokens). The rows past the tokenizer are not tokens: nothing decodes them, a
teacher has never seen them as text. `vocab_limit` (the tokenizer's `vocab_size`, passed in by
whoever built the tokenizer: generate, sequence KD, on-policy distillation, the demo) masks them
out of every draw, greedy included, so a sampled id is always one the tokenizer can emit. The
reported `logprobs_BxT` stay those of the model's full softmax (what the losses see, padded rows
included: see distill/logits.py); `sample_logprobs_BxT` are those of the masked distribution the
token was actually drawn from.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from distillax import partitioning as pt
from distillax.errors import UserError
from distillax.models.attention.layer import KVCache
from distillax.models.init import RulesLike, resolve_rules
from distillax.models.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to pick each token. temperature 0 is greedy (top_k / top_p are then ignored)."""

  max_new_tokens: int
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  eos_id: int | None = None
  pad_id: int = 0
  stop_ids: tuple[int, ...] = ()  # more ids that end a row like EOS (e.g. an end of turn)
  vocab_limit: int | None = None  # ids >= it are never drawn: the tokenizer's vocab_size

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise UserError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
    if self.temperature < 0:
      raise UserError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
    if self.top_k is not None and self.top_k < 1:
      raise UserError(f"top_k={self.top_k} must be >= 1 or None")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise UserError(f"top_p={self.top_p} must be in (0, 1] or None")
    if self.vocab_limit is not None and self.vocab_limit < 1:
      raise UserError(f"vocab_limit={self.vocab_limit} must be >= 1 (the tokenizer's vocab_size) "
                      f"or None")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerationOutput:
  """tokens_BxT: generated tokens, pad_id after an EOS. lengths_B: tokens generated per row
  (EOS included). logprobs_BxT: the model's log-probability (temperature 1, no filtering) of
  each generated token, 0 after EOS: what sequence-level distillation needs.
  sample_logprobs_BxT: the log-probability of each token under the distribution it was drawn
  from (temperature, top-k, top-p applied; 0 when greedy and after EOS): what an importance
  weight between sampler and learner needs."""

  tokens_BxT: jax.Array
  lengths_B: jax.Array
  logprobs_BxT: jax.Array
  sample_logprobs_BxT: jax.Array


def filter_logits(logits_BxV: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Temperature, then top-k, then top-p (nucleus) filtering; removed tokens get -inf."""
  logits = logits_BxV.astype(jnp.float32) / cfg.temperature
  if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
    kth_Bx1 = jax.lax.top_k(logits, cfg.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth_Bx1, -jnp.inf, logits)
  if cfg.top_p is not None and cfg.top_p < 1:
    sorted_BxV = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_BxV, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    keep = before < cfg.top_p  # the best token always stays
    threshold_Bx1 = jnp.min(jnp.where(keep, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold_Bx1, -jnp.inf, logits)
  return logits


def sample_token(logits_BxV: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """One token per row; `key` is one key for the batch, or a (B,) array of per-row keys."""
  return _sample(logits_BxV, key, cfg)[0]


def mask_padded_ids(logits_BxV: jax.Array, vocab_limit: int | None) -> jax.Array:
  """`logits_BxV` with the ids at or past `vocab_limit` (a padded vocabulary's rows that no
  tokenizer id names) set to -inf, so no draw can pick them."""
  if vocab_limit is None or vocab_limit >= logits_BxV.shape[-1]:
    return logits_BxV
  real_V = jnp.arange(logits_BxV.shape[-1]) < vocab_limit
  return jnp.where(real_V, logits_BxV, -jnp.inf)


def _sample(logits_BxV, key, cfg: SamplingConfig):
  """(token_B, log-probability of it under the distribution it was drawn from)."""
  logits_BxV = mask_padded_ids(logits_BxV, cfg.vocab_limit)
  if cfg.temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32), jnp.zeros(logits_BxV.shape[:1])
  filtered_BxV = filter_logits(logits_BxV, cfg)
  if _per_row(key):  # a row's draw does not depend on the other rows
    token_B = jax.vmap(jax.random.categorical)(key, filtered_BxV).astype(jnp.int32)
  else:
    token_B = jax.random.categorical(key, filtered_BxV, axis=-1).astype(jnp.int32)
  logp_B = jnp.take_along_axis(jax.nn.log_softmax(filtered_BxV), token_B[:, None], -1)[:, 0]
  return token_B, logp_B


def right_align(prompt_BxP: jax.Array, lengths_B: jax.Array):
  """(prompt, segment ids, positions), each (B, P): row b moved P - lengths_B[b] slots right,
  the wrapped-in slots padding (segment 0), positions counting real tokens from 0."""
  B, P = prompt_BxP.shape
  shift_B = P - lengths_B
  prompt_BxP = jax.vmap(jnp.roll)(prompt_BxP, shift_B)
  slots_BxP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  segments_BxP = (slots_BxP >= shift_B[:, None]).astype(jnp.int32)
  positions_BxP = jnp.maximum(slots_BxP - shift_B[:, None], 0)
  return prompt_BxP, segments_BxP, positions_BxP


def _per_row(key: jax.Array) -> bool:
  """A (B,) array of typed PRNG keys, one per row (a raw uint32[2] key is one key)."""
  return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1


def _step_keys(key: jax.Array, steps: int) -> jax.Array:
  """One key per decode step, (steps,), or (steps, B) from (B,) per-row keys."""
  if _per_row(key):
    return jax.vmap(lambda t: jax.vmap(jax.random.fold_in, (0, None))(key, t))(
        jnp.arange(steps))
  return jax.random.split(key, steps)


# Weights some layers read at float32 rather than the compute dtype (attention sinks, the linear
# attention's convolution, adapters): never narrowed by weights_in_compute_dtype.
_KEPT_WIDE = frozenset({"sinks", "conv", "lora_a", "lora_b"})


def weights_in_compute_dtype(model: Transformer) -> Transformer:
  """The model over a copy of its matmul weights (float parameters of two or more dimensions)
  in its compute dtype, cast once: a decode loop then reads bf16 weights at each of its steps
  rather than reading the fp32 master weights and casting them again at every token. Exact for
  the weights every layer casts to the compute dtype where it uses them (vectors such as norm
  scales, and _KEPT_WIDE, stay as stored). A plain Transformer only: a fake-quantized or adapted
  model quantizes or adds to its stored weights, which this would change."""
  graph, state = nnx.split(model)
  return nnx.merge(graph, matmul_weights_in(state, model.config.dtype))


def matmul_weights_in(state, dtype):
  """`state` (a model's nnx state or pure dict) with the weights weights_in_compute_dtype casts
  in `dtype`: what an on-policy sampler on devices of its own receives
  (trainers/on_policy/sampler_devices.py), half the bytes of fp32 master weights."""
  dtype = jnp.dtype(dtype)

  def cast(path, x):
    wide = (jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2
            and x.dtype.itemsize > dtype.itemsize)
    named = {str(getattr(k, "key", k)) for k in path}
    return x.astype(dtype) if wide and not named & _KEPT_WIDE else x

  return jax.tree_util.tree_map_with_path(cast, state)


def decode(model: Transformer, prompt_BxP: jax.Array, lengths_B: jax.Array, key: jax.Array,
           cfg: SamplingConfig, cache_dtype=None) -> GenerationOutput:
  """Continues each prompt (right-padded, real lengths `lengths_B`) by `cfg.max_new_tokens`
  tokens: one prefill and a `lax.scan` of single-token steps over a KV cache. A pure function
  of the model's arrays, callable inside any traced program (the Sampler's jit, a train
  step). `key`: one PRNG key, or a (B,) array of keys, one per row."""
  B, P = prompt_BxP.shape
  prompt_BxP, segments_BxP, positions_BxP = right_align(prompt_BxP, lengths_B)
  cache = KVCache.zeros(model.config, B, P + cfg.max_new_tokens, cache_dtype)
  out = model(prompt_BxP, positions_BxL=positions_BxP, segment_ids_BxL=segments_BxP,
              cache=cache, return_logits=False)
  logits_BxV = model.logits_from_hidden(out.final_hidden_BxLxD[:, -1])
  stops = tuple(dict.fromkeys(([] if cfg.eos_id is None else [cfg.eos_id]) + list(cfg.stop_ids)))

  def emit(logits_BxV, key, done_B):
    token_B, sample_logp_B = _sample(logits_BxV, key, cfg)
    logprob_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BxV), token_B[:, None], -1)[:, 0]
    token_B = jnp.where(done_B, cfg.pad_id, token_B)
    logprob_B = jnp.where(done_B, 0.0, logprob_B)
    sample_logp_B = jnp.where(done_B, 0.0, sample_logp_B)
    now_done_B = done_B
    for stop in stops:
      now_done_B = now_done_B | (token_B == stop)
    return token_B, (logprob_B, sample_logp_B), now_done_B

  def step(carry, step_key):
    cache, token_B, position_B, done_B = carry
    out = model(token_B[:, None], positions_BxL=position_B[:, None],
                segment_ids_BxL=jnp.ones((B, 1), jnp.int32), cache=cache)
    next_B, logprobs, next_done_B = emit(out.logits_BxLxV[:, 0], step_key, done_B)
    return (out.cache, next_B, position_B + 1, next_done_B), (next_B, logprobs, done_B)

  keys = _step_keys(key, cfg.max_new_tokens)
  first_B, first_logprobs, done_B = emit(logits_BxV, keys[0], jnp.zeros((B,), bool))
  carry = (out.cache, first_B, lengths_B, done_B)
  _, (rest_TxB, rest_logprobs, was_done_TxB) = jax.lax.scan(step, carry, keys[1:])
  join = lambda first_B, rest_TxB: jnp.concatenate([first_B[:, None], rest_TxB.T], axis=1)
  # A token counts unless the row had already finished before it.
  counted_BxT = jnp.concatenate([jnp.ones((B, 1), bool), ~was_done_TxB.T], axis=1)
  return GenerationOutput(join(first_B, rest_TxB), counted_BxT.sum(axis=1).astype(jnp.int32),
                          join(first_logprobs[0], rest_logprobs[0]),
                          join(first_logprobs[1], rest_logprobs[1]))


def _generate(graphdef, state, prompt_BxP, lengths_B, key, cfg: SamplingConfig, cache_dtype):
  return decode(nnx.merge(graphdef, state), prompt_BxP, lengths_B, key, cfg, cache_dtype)


class Sampler:
  """Compiled generation for one model; one compile per prompt shape and SamplingConfig."""

  def __init__(self, model: Transformer, *, mesh: Mesh | None = None, rules: RulesLike = None,
               cache_dtype: str | None = None):
    self.graphdef, self.state = nnx.split(model)
    self.config = model.config
    self.mesh = mesh
    self.rules = resolve_rules(rules) if mesh is not None else None
    self.cache_dtype = cache_dtype or model.config.dtype
    self._compiled = {}

  def _fn(self, cfg: SamplingConfig):
    if cfg not in self._compiled:
      fn = functools.partial(_generate, self.graphdef, cfg=cfg, cache_dtype=self.cache_dtype)
      if self.mesh is not None:
        inner = fn

        def fn(*args):
          with pt.use_rules(self.mesh, self.rules):
            return inner(*args)
      self._compiled[cfg] = jax.jit(fn)
    return self._compiled[cfg]

  def __call__(self, prompt_tokens_BxP, prompt_lengths_B=None, *, max_new_tokens: int,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               eos_id: int | None = None, pad_id: int = 0, seed: int | jax.Array = 0,
               vocab_limit: int | None = None) -> GenerationOutput:
    """Continues each prompt. prompt_tokens_BxP is right-padded; prompt_lengths_B gives each
    row's real length (default: all P tokens). seed: an int or a PRNG key. vocab_limit: the
    tokenizer's vocab_size (ids past it are padding rows, never drawn); None draws from every
    row of the model's vocabulary."""
    cfg = SamplingConfig(max_new_tokens, float(temperature), top_k, top_p, eos_id, pad_id,
                         vocab_limit=vocab_limit)
    prompt = jnp.asarray(prompt_tokens_BxP, jnp.int32)
    B, P = prompt.shape
    if P + max_new_tokens > self.config.max_seq_len:
      raise UserError(f"prompt length {P} + max_new_tokens {max_new_tokens} exceeds the model's "
                      f"max_seq_len={self.config.max_seq_len}; shorten one of them")
    lengths = (jnp.full((B,), P, jnp.int32) if prompt_lengths_B is None
               else jnp.asarray(prompt_lengths_B, jnp.int32))
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    return self._fn(cfg)(self.state, prompt, lengths, key)


def generate(model: Transformer, prompt_tokens_BxP, prompt_lengths_B=None, *,
             mesh: Mesh | None = None, rules: RulesLike = None, **sampling) -> GenerationOutput:
  """One-off generation (builds a Sampler; keep a Sampler to reuse its compiled function)."""
  return Sampler(model, mesh=mesh, rules=rules)(prompt_tokens_BxP, prompt_lengths_B, **sampling)
