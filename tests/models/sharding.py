"""Real `Transformer` parameter trees for sharding tests: shapes and logical axes, no memory.

The partitioning package may not import the models (it sits a floor below them), so its tests
take their trees from here: the very parameters a run shards, read off `nnx.eval_shape`, rather
than a hand-written imitation that can drift from the model.
"""

from __future__ import annotations

from flax import nnx

from distillax import partitioning as pt
from distillax.models.presets import get_preset
from distillax.models.init import abstract_model


def param_tree(preset: str, **overrides) -> tuple[dict, dict]:
  """(abstract params, logical specs) of model preset `preset` (fields replaced by `overrides`).

  Both are pure dicts shaped like `nnx.state(model, nnx.Param)`: ShapeDtypeStructs and logical
  PartitionSpecs. Built abstractly, so published shapes such as 'llama3.2-1b' cost no memory.
  """
  state = nnx.state(abstract_model(get_preset(preset, **overrides)), nnx.Param)
  return nnx.to_pure_dict(state), pt.logical_tree(state)


def plan(preset: str, strategy: str, data: int, model: int, *,
         replicate_indivisible: bool = False, **overrides) -> list[pt.PlanRow]:
  """`pt.describe` of the preset's parameters under `strategy` on a data x model mesh."""
  abstract, logical = param_tree(preset, **overrides)
  mesh = pt.create_mesh({"data": data, "model": model})
  rules = pt.rules_from_config({"strategy": strategy,
                                "replicate_indivisible": replicate_indivisible})
  return pt.describe(abstract, logical, mesh, rules)


def rows_by_path(rows) -> dict[str, pt.PlanRow]:
  return {r.path: r for r in rows}
