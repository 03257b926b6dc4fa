"""Shared helpers for the model tests: random models without compiling an init, jitted calls."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax.models.init import abstract_model
from distillax.models.transformer import layer_params


def random_model(config, seed: int = 0, scale: float = 0.3):
  """A model whose every parameter (norm scales too) is drawn with numpy: no XLA compile."""
  graphdef, state = nnx.split(abstract_model(config))
  rng = np.random.default_rng(seed)
  values = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * scale, x.dtype),
                        nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, values)
  return nnx.merge(graphdef, state)


@functools.partial(nnx.jit, static_argnames=("return_hidden_states", "return_attention"))
def forward(model, tokens_BxL, positions_BxL=None, segment_ids_BxL=None, cache=None,
            return_hidden_states=False, return_attention=False):
  """`model(...)` under jit (eager op-by-op dispatch is slow on a shared 2-core machine)."""
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
