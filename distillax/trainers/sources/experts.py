"""A student derived from teacher blocks that keeps a subset of each layer's experts
(`student.from_teacher.experts`): pruning a mixture of experts by load, then distilling.

Student expert j of a layer is teacher expert kept[j] of the block it copies: its gate, up and
down weights (and biases, where the family has them) and its router column are copied, so the
student's router scores the kept experts exactly as the teacher did. What changes is what the
router normalises over: a softmax over all E logits (softmax_topk) becomes one over the kept
ones, so the student's routing weights equal the teacher's only renormalised (or for
topk_softmax, whenever the teacher's top k are all kept). The router distillation strategy
(distill/router_kd.py) reads the same mapping to compare the two routers.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp

from distillax.errors import ConfigError
from distillax.models.config import TransformerConfig

FIELD = "student.from_teacher.experts"


def _index(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def kept_experts(experts: Sequence[Any], layers: Sequence[int], teacher: TransformerConfig
                 ) -> tuple[tuple[int, ...], ...] | None:
  """Per student layer, the teacher experts it keeps, in student order; None = all of them.
  A block the teacher runs as a dense MLP (DeepSeek V3's and GLM-4.5's first layers) keeps ().

  `experts`: () (all), one tuple of teacher expert indices for every layer, one tuple per
  student layer (block `layers[i]` of the teacher), or, for a student of fewer blocks, one per
  teacher layer (as `distillax expert-load --keep_top` prints them); a dense block's tuple is
  () (any tuple given for it is ignored: it has no experts)."""
  experts = tuple(experts or ())
  if not experts:
    return None
  num_layers = len(layers)
  if len(experts) == teacher.num_layers != num_layers and all(
      isinstance(row, (tuple, list)) for row in experts):
    experts = tuple(experts[t] for t in layers)
  E, k = teacher.num_experts, teacher.num_experts_per_tok
  if not E:
    raise ConfigError(f"{FIELD}={experts!r} keeps experts, but the teacher is dense "
                      f"(model.num_experts=0); clear {FIELD}")
  routed = [teacher.layer_is_moe(t) for t in layers]
  is_row = lambda row, moe: isinstance(row, (tuple, list)) and all(_index(e) for e in row) and (
      bool(row) or not moe)
  if all(_index(e) for e in experts):
    per_layer = (experts,) * num_layers
  elif len(experts) == num_layers and all(is_row(r, moe) for r, moe in zip(experts, routed)):
    per_layer = tuple(tuple(row) for row in experts)
  else:
    example = tuple((0, 1) if moe else () for moe in routed)
    raise ConfigError(f"{FIELD}={experts!r} must list teacher expert indices (0..{E - 1}) kept "
                      f"in every layer, e.g. (0, 3, 5), or one such tuple per student layer "
                      f"({num_layers}) or teacher layer ({teacher.num_layers}), () for a dense "
                      f"layer, e.g. {example}")
  per_layer = tuple(row if moe else () for row, moe in zip(per_layer, routed))
  if not any(routed):
    return None
  for i, row in enumerate(per_layer):
    outside = sorted({e for e in row if e >= E})
    if outside:
      raise ConfigError(f"{FIELD} names expert(s) {outside} (student layer {i}) but the teacher "
                        f"has {E} per layer (0..{E - 1}); pick experts it has")
    twice = sorted({e for e in row if row.count(e) > 1})
    if twice:
      raise ConfigError(f"{FIELD} keeps expert(s) {twice} twice in student layer {i}; list "
                        f"each kept expert once")
  counts = sorted({len(row) for row, moe in zip(per_layer, routed) if moe})
  if len(counts) > 1:
    raise ConfigError(f"{FIELD} keeps {[len(r) for r, moe in zip(per_layer, routed) if moe]} "
                      f"experts in the routed student layers; every layer must keep the same "
                      f"number (model.num_experts is one number)")
  if counts[0] < k:
    raise ConfigError(f"{FIELD} keeps {counts[0]} experts per layer, but the teacher routes "
                      f"each token to {k} (model.num_experts_per_tok={k}); keep at least {k}")
  return per_layer


def with_kept_experts(cfg: TransformerConfig, kept) -> TransformerConfig:
  """The student config of `cfg`'s blocks keeping `kept` (None: unchanged). Expert groups
  (DeepSeek's n_group) are consecutive expert indices, which a subset does not keep."""
  if kept is not None and cfg.router_groups > 1:
    raise ConfigError(f"{FIELD} keeps a subset of each layer's experts, but the teacher routes "
                      f"within model.router_groups={cfg.router_groups} groups of consecutive "
                      f"experts that a subset breaks; clear {FIELD} (keep every expert)")
  return cfg if kept is None else cfg.replace(num_experts=max(len(row) for row in kept))


def slice_layer(values: dict, kept_layer: Sequence[int] | None) -> dict:
  """One block's parameter values with its experts cut to `kept_layer` (in that order): the
  router's expert columns (its last axis) and every other MoE array's leading expert axis; a
  module beside the experts (Qwen3.5-MoE's shared expert, Gemma 4's dense MLP and norms) and
  Gemma 4's router input scale are kept whole."""
  if kept_layer is None or "router" not in values["mlp"]:  # a dense layer keeps its MLP
    return values
  index = jnp.asarray(kept_layer, jnp.int32)
  cut = lambda name, v: jnp.take(v, index, axis=v.ndim - 1 if name == "router" else 0)
  whole = lambda name, v: isinstance(v, dict) or name == "router_scale"  # (Gemma 4's: embed)
  mlp = {name: v if whole(name, v) else cut(name, v) for name, v in values["mlp"].items()}
  return {**values, "mlp": mlp}
