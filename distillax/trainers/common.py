"""Small pieces every recipe shares: the model config a job's data implies, and placing modules
created after the sharded init (adapters, projections) on the mesh."""

from __future__ import annotations

import jax
from flax import nnx

from distillax import partitioning as pt
from distillax.data import check_vocab, padded_vocab_size
from distillax.models.config import TransformerConfig

def resolve_model_config(model_cfg, tokenizer) -> TransformerConfig:
  """The model's TransformerConfig with the vocabulary taken from, or checked against, data."""
  values = dict(model_cfg)
  if int(values.get("vocab_size") or 0) <= 0:
    values["vocab_size"] = padded_vocab_size(tokenizer)
  cfg = TransformerConfig.from_dict(values)
  check_vocab(tokenizer, cfg.vocab_size)
  return cfg


def place_module(module: nnx.Module, mesh, rules) -> nnx.Module:
  """Puts every variable of `module` on the mesh by its logical axes (for parts created after
  the sharded init: adapters, projections)."""
  graph, state = nnx.split(module)
  values = nnx.to_pure_dict(state)
  shardings = pt.tree_shardings(values, pt.logical_tree(state), mesh, rules)
  return nnx.merge(graph, jax.device_put(values, shardings))
