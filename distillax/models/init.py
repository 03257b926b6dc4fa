"""Sharded model creation without host materialisation.

The model is first built abstractly (`nnx.eval_shape`: shapes, dtypes and `logical_axes`
metadata, no memory); the rules turn the logical axes into NamedShardings on the mesh; a `jit`
with those `out_shardings` then creates every parameter directly in its shards, so no device and
no host ever holds a full copy of a sharded parameter.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
from flax import nnx
from jax.sharding import Mesh

from distillax import partitioning as pt
from distillax.errors import ConfigError
from distillax.models.config import TransformerConfig
from distillax.models.transformer import Transformer

RulesLike = pt.RuleSet | str | Mapping[str, Any] | None


def resolve_rules(rules: RulesLike) -> pt.RuleSet:
  """A RuleSet from a RuleSet, a preset name ('fsdp', 'tp', ...), a partitioning config or None
  (None means the default strategy, 'fsdp')."""
  if isinstance(rules, pt.RuleSet):
    return rules
  if rules is None:
    return pt.rules_from_config({"strategy": "fsdp"})
  if isinstance(rules, str):
    return pt.rules_from_config({"strategy": rules})
  if hasattr(rules, "get"):
    return pt.rules_from_config(rules)
  raise ConfigError(f"rules={rules!r} is not a RuleSet, a preset name or a partitioning config; "
                    f"pass e.g. 'fsdp' or distillax.partitioning.rules_from_config(cfg)")


def abstract_model(config: TransformerConfig, seed: int = 0) -> Transformer:
  """The model with ShapeDtypeStructs instead of arrays (costs no memory)."""
  return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed)))


def param_count(config: TransformerConfig) -> int:
  """Number of parameters, computed from the abstract model's shapes."""
  state = nnx.state(abstract_model(config), nnx.Param)
  return sum(int(x.size) for x in jax.tree.leaves(nnx.to_pure_dict(state)))


def model_shardings(model: Transformer, mesh: Mesh, rules: RulesLike = None) -> dict:
  """NamedShardings of every model variable (a pure dict shaped like `nnx.state(model)`)."""
  state = nnx.state(model)
  return pt.tree_shardings(nnx.to_pure_dict(state), pt.logical_tree(state), mesh,
                           resolve_rules(rules))


def create_model(config: TransformerConfig, *, mesh: Mesh | None = None, rules: RulesLike = None,
                 seed: int = 0) -> Transformer:
  """A freshly initialised model whose parameters are created already sharded on `mesh`.

  Without a mesh the parameters live on the default device. `rules` defaults to 'fsdp'.
  """
  graphdef, abstract_state = nnx.split(abstract_model(config, seed))

  def init_values():
    return nnx.to_pure_dict(nnx.state(Transformer(config, rngs=nnx.Rngs(seed))))

  if mesh is None:
    values = jax.jit(init_values)()
  else:
    shardings = pt.tree_shardings(nnx.to_pure_dict(abstract_state),
                                  pt.logical_tree(abstract_state),
                                  mesh, resolve_rules(rules))
    values = jax.jit(init_values, out_shardings=shardings)()
  nnx.replace_by_pure_dict(abstract_state, values)
  return nnx.merge(graphdef, abstract_state)
