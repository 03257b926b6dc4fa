"""Tiny model presets, random models made with numpy, and jitted forwards.

Random models are drawn with numpy, not by the model's own init: a jitted init compiles for
seconds per shape on a busy 2-core machine, a numpy draw costs nothing. Each kind of test wants
another draw (an `init` rule below); the model around the values is built one way for all.
"""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax import partitioning as pt
from distillax.models.presets import get_preset
from distillax.models.init import abstract_model, model_shardings
from distillax.models.transformer import layer_params

# 8 query heads over 4 kv heads, so every strategy preset places it on meshes with model <= 4.
TINY = get_preset("tiny", num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=128)
# One layer: what the engine tests compile (compile time dominates them on 2 cores).
TINY1 = TINY.replace(num_layers=1)


def _leaf_name(path) -> str:
  """'layers/0/attn/q' for a pure-dict path."""
  return "/".join(str(getattr(k, "key", k)) for k in path)


@dataclasses.dataclass(frozen=True)
class Normal:
  """Every parameter N(0, scale^2), norm scales too: far from any trained model, so two
  implementations of one forward are compared on all of their arithmetic."""
  scale: float = 0.3

  def __call__(self, config, leaves, rng):
    return {name: rng.normal(size=x.shape) * self.scale for name, x in leaves}


@dataclasses.dataclass(frozen=True)
class NormsNearOne:
  """Vectors (norm scales) 1 + N(0, 0.01), matrices N(0, 1 / dim[-2]): activations stay in a sane
  range, as the distillation tests' losses need."""

  def __call__(self, config, leaves, rng):
    def value(x):
      if len(x.shape) == 1:
        return (1.0 + 0.1 * rng.standard_normal(x.shape)).astype(x.dtype)
      return (rng.standard_normal(x.shape) * x.shape[-2] ** -0.5).astype(x.dtype)
    return {name: value(x) for name, x in leaves}


@dataclasses.dataclass(frozen=True)
class FanIn:
  """Unit norm scales, weights N(0, 1 / fan_in), embeddings N(0, 0.02^2): a freshly initialised
  model, as training (and quantizing) starts from."""

  def __call__(self, config, leaves, rng):
    def value(name, x):
      if name.endswith("scale"):
        return np.ones(x.shape, np.float32)
      if "embedding" in name:
        return rng.normal(size=x.shape) * 0.02
      fan_in = x.shape[-3] * x.shape[-2] if name.endswith("attn/o") else x.shape[-2]
      return rng.normal(size=x.shape) / np.sqrt(fan_in)
    return {name: value(name, x) for name, x in leaves}


@dataclasses.dataclass(frozen=True)
class Peaked:
  """A clear next token, so greedy decoding never meets a near-tie: embeddings of unit variance
  carry the residual stream (the blocks, at 0.5 / sqrt(fan_in), perturb it), and each output row
  is `logit_gain` times the normalised embedding of the token it should follow under a fixed
  random permutation (tied models: the token itself). Norm scales and biases are drawn away from
  their init so export tests check those tensors too."""
  logit_gain: float = 1.5

  def __call__(self, config, leaves, rng):
    values = {}
    for name, x in leaves:
      if name.endswith(("norm/scale", "/scalar")):  # Gemma 4's layer scalars start at 1 too
        values[name] = (0.0 if config.norm_scale_plus_one else 1.0) + 0.1 * rng.normal(
            size=x.shape)
      elif name.endswith("_bias"):
        values[name] = 0.1 * rng.normal(size=x.shape)
      elif name == "embedder/embedding":
        values[name] = rng.normal(size=x.shape) / (np.sqrt(config.embed_dim)
                                                   if config.scale_embeddings else 1.0)
      elif name != "lm_head":
        fan_in = x.shape[0] * x.shape[1] if name.endswith("attn/o") else x.shape[0]
        values[name] = 0.5 * rng.normal(size=x.shape) / np.sqrt(fan_in)
    if not config.tie_embeddings:
      embedding = values["embedder/embedding"]
      unit = embedding / np.linalg.norm(embedding, axis=1, keepdims=True)
      head = np.zeros((config.embed_dim, config.vocab_size))
      head[:, rng.permutation(config.vocab_size)] = unit.T * self.logit_gain
      values["lm_head"] = head
    return values


NORMS_NEAR_ONE, FAN_IN, PEAKED = NormsNearOne(), FanIn(), Peaked()


@functools.cache
def _values(config, seed: int, init) -> dict[str, np.ndarray]:
  """Numpy values by leaf name, drawn in the state's leaf order (cached: same config, seed and
  rule, same values; callers get fresh device arrays)."""
  flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(abstract_model(config))))
  return init(config, [(_leaf_name(p), x) for p, x in flat[0]], np.random.default_rng(seed))


def random_model(config, seed: int = 0, init=Normal(), *, mesh=None, strategy: str = "fsdp"):
  """A model of `config` whose parameters `init` draws from numpy (no XLA compile); placed by
  `strategy`'s rules on `mesh` when one is given."""
  graphdef, state = nnx.split(abstract_model(config))
  values = _values(config, seed, init)
  arrays = jax.tree_util.tree_map_with_path(
      lambda p, x: jnp.array(values[_leaf_name(p)], x.dtype), nnx.to_pure_dict(state))
  if mesh is not None:
    shardings = model_shardings(nnx.merge(graphdef, state), mesh,
                                pt.rules_from_config({"strategy": strategy}))
    arrays = jax.device_put(arrays, shardings)
  nnx.replace_by_pure_dict(state, arrays)
  return nnx.merge(graphdef, state)


def logits(model, tokens_BxL, gelu=None):
  """model(tokens).logits under jit (eager dispatch is slow on a shared 2-core machine), compiled
  once per GraphDef; `gelu` replaces jax.nn.gelu while tracing (a runtime's own GELU)."""
  graphdef, state = nnx.split(model)
  return _logits(graphdef, state, jnp.asarray(tokens_BxL, jnp.int32), gelu)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _logits(graphdef, state, tokens_BxL, gelu):
  if gelu is None:
    return nnx.merge(graphdef, state)(tokens_BxL).logits_BxLxV
  with mock.patch.object(jax.nn, "gelu", gelu):  # at trace time
    return nnx.merge(graphdef, state)(tokens_BxL).logits_BxLxV


def greedy_tokens(model, prompts_BxP, new_tokens: int, vocab_limit: int) -> np.ndarray:
  """Greedy continuations (B, new_tokens) of equal-length prompts, by one full causal forward per
  token over a fixed-length buffer (later slots cannot change earlier logits): no KV cache, no
  sampler. The argmax is among the first `vocab_limit` ids (a padded vocabulary's rows, which
  fresh weights would otherwise pick, are never drawn, as the samplers draw)."""
  prompts = np.asarray(prompts_BxP, np.int32)
  B, P = prompts.shape
  tokens = np.zeros((B, P + new_tokens), np.int32)
  tokens[:, :P] = prompts
  for n in range(P, P + new_tokens):
    tokens[:, n] = np.argmax(np.asarray(logits(model, tokens)[:, n - 1, :vocab_limit]), -1)
  return tokens[:, P:]


@functools.partial(nnx.jit, static_argnames=("return_hidden_states", "return_attention"))
def forward(model, tokens_BxL, positions_BxL=None, segment_ids_BxL=None, cache=None,
            return_hidden_states=False, return_attention=False):
  """`model(...)` under jit, every output and option of the model's call."""
  return model(tokens_BxL, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
               cache=cache, return_hidden_states=return_hidden_states,
               return_attention=return_attention)


def numpy_params(model):
  """(layers, embedding, final_norm, lm_head) as float64 numpy, for tests/models/reference.py."""
  to_np = lambda t: jax.tree.map(lambda a: np.asarray(a, np.float64), t)
  layers = [to_np(p) for p in layer_params(model)]
  embedding = np.asarray(model.embedder.embedding[...], np.float64)
  final_norm = np.asarray(model.final_norm.scale[...], np.float64)
  lm_head = None if model.lm_head is None else np.asarray(model.lm_head[...], np.float64)
  return layers, embedding, final_norm, lm_head


def param_arrays(model) -> dict[str, np.ndarray]:
  """Every nnx.Param of `model` as numpy, keyed by its path."""
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in
          jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]}
