"""Logical axis rules: the one place that decides DP, FSDP, TP or both.

Every parameter and activation names its dims logically (`embed`, `mlp`, `heads`, ...). A rule
set is an ordered list of `(logical_name, mesh_axis | tuple_of_axes | None)`. Per array, each dim
takes the first rule for its name whose mesh axes are all still free in that array's spec; later
rules for the same name are fallbacks; `None` means replicated. flax's own
`nnx.logical_axis_rules` resolves rules as a dict (last wins, no fallbacks, unknown names passed
through as mesh axes), which is why distillax resolves logical names itself.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence, Union

from jax.sharding import Mesh, PartitionSpec

from distillax.errors import PartitioningError

MeshAxes = Union[str, tuple[str, ...], None]
Rule = tuple[str, MeshAxes]
LogicalAxes = tuple[Union[str, None], ...]

# The shared vocabulary of models, rules and activation constraints.
LOGICAL_AXES = {
    "batch": "examples in a batch (activations)",
    "length": "sequence positions (attention and MLP activations, KV cache)",
    # The (B, L, embed) tensors between the matmuls: embeddings, block outputs, the attention
    # and MLP outputs. Replicated by default; sequence parallelism shards it over the axis that
    # tensor parallelism leaves these tensors replicated on.
    "residual_length": "sequence positions of the residual stream (B, L, embed)",
    "vocab": "token vocabulary (embedding table, output logits)",
    "embed": "model width (residual stream, norm scales)",
    "mlp": "feed-forward hidden width",
    "heads": "query attention heads",
    "kv_heads": "key/value attention heads (GQA/MQA)",
    "head_dim": "per-head feature dimension",
    # DeepSeek's latent attention: its compressed query and key/value widths, which the
    # fsdp presets split as they split embed (a matrix holding both splits embed first).
    "latent": "compressed width of multi-head latent attention (q_lora_rank, kv_lora_rank)",
    "layers": "stacked layers under scan",
    "expert": "mixture-of-experts experts (stacked expert weights, router outputs)",
}

_REPLICATE_REST = tuple((name, None) for name in LOGICAL_AXES)


def _preset(*rules: Rule) -> tuple[Rule, ...]:
  """A preset's own rules followed by a replicated fallback for every logical name."""
  return tuple(rules) + _REPLICATE_REST


# Presets as plain data. The trailing (name, None) fallbacks make every vocabulary name known and
# say what happens when a name's preferred axis is already taken in a spec: replicate that dim.
_PRESETS: dict[str, tuple[Rule, ...]] = {
    # Data parallel: params replicated, batch over data.
    "dp": _preset(("batch", "data")),
    # Fully sharded data parallel: params and optimizer state sharded over data by model width.
    "fsdp": _preset(("batch", "data"), ("embed", "data"), ("latent", "data")),
    # Tensor parallel: heads, MLP and vocab over model (Megatron-style column/row split).
    "tp": _preset(("batch", "data"), ("heads", "model"), ("kv_heads", "model"), ("mlp", "model"),
                  ("vocab", "model")),
    # Both: width over data, heads/mlp/vocab over model.
    "fsdp_tp": _preset(("batch", "data"), ("embed", "data"), ("latent", "data"),
                       ("heads", "model"), ("kv_heads", "model"), ("mlp", "model"),
                       ("vocab", "model")),
    # Sequence parallelism on top of tp / fsdp_tp (Megatron-style): the residual stream is
    # split along its length over model as well, so each device keeps 1/model of it; every
    # all-reduce of a TP block output becomes a reduce-scatter, and the block inputs are
    # all-gathered along the length before the column-parallel matmuls. Parameters are laid out
    # exactly as in tp / fsdp_tp.
    "tp_sp": _preset(("batch", "data"), ("residual_length", "model"), ("heads", "model"),
                     ("kv_heads", "model"), ("mlp", "model"), ("vocab", "model")),
    "fsdp_tp_sp": _preset(("batch", "data"), ("residual_length", "model"), ("embed", "data"),
                          ("latent", "data"), ("heads", "model"), ("kv_heads", "model"),
                          ("mlp", "model"), ("vocab", "model")),
    # Expert parallelism (mixture-of-experts models) as placement only: each data group holds
    # num_experts / data of every layer's experts, whole (their width is not also split over
    # data: that axis is taken), and GSPMD moves the routed tokens to them. fsdp_ep: the rest
    # as fsdp (MaxText's experts-as-data-parallel); ep_tp: the rest as tp, the experts' own
    # mlp width over model. On a dense model both are fsdp / tp.
    "fsdp_ep": _preset(("batch", "data"), ("expert", "data"), ("embed", "data"),
                       ("latent", "data")),
    "ep_tp": _preset(("batch", "data"), ("expert", "data"), ("heads", "model"),
                     ("kv_heads", "model"), ("mlp", "model"), ("vocab", "model")),
}
BUILTIN_PRESETS = tuple(_PRESETS)


def register_preset(name: str, rules: Iterable[Rule], *, overwrite: bool = False) -> None:
  """Adds a named preset so configs can select it with `partitioning.strategy=name`."""
  if name in _PRESETS and not overwrite:
    raise PartitioningError(f"partitioning preset {name!r} already exists; pass overwrite=True "
                            f"or choose another name")
  _PRESETS[name] = tuple(_check_rule(r) for r in rules)


def preset_names() -> tuple[str, ...]:
  return tuple(_PRESETS)


def preset(name: str) -> tuple[Rule, ...]:
  if name not in _PRESETS:
    raise PartitioningError(
        f"unknown partitioning strategy {name!r}; choose one of {', '.join(_PRESETS)} or "
        f"register your own with distillax.partitioning.rules.register_preset")
  return _PRESETS[name]


def _check_rule(rule) -> Rule:
  if (not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str)):
    raise PartitioningError(f"rule {rule!r} is not a (logical_name, mesh_axes) pair; write e.g. "
                            f"('mlp', 'model') or ('embed', None)")
  name, axes = rule
  if isinstance(axes, list):
    axes = tuple(axes)
  if axes is not None and not isinstance(axes, str) and not (
      isinstance(axes, tuple) and all(isinstance(a, str) for a in axes)):
    raise PartitioningError(f"rule {rule!r}: mesh axes must be a name, a tuple of names or None")
  return (name, axes)


def axes_tuple(axes: MeshAxes) -> tuple[str, ...]:
  """The mesh axes of one rule or PartitionSpec entry: None -> (), 'data' -> ('data',)."""
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclasses.dataclass(frozen=True)
class RuleSet:
  """An ordered rule list plus how to treat dims a mesh axis does not divide."""

  rules: tuple[Rule, ...]
  replicate_indivisible: bool = False
  name: str = "custom"

  def __post_init__(self):
    object.__setattr__(self, "rules", tuple(_check_rule(r) for r in self.rules))

  @property
  def known_names(self) -> frozenset[str]:
    return frozenset(n for n, _ in self.rules)

  def check_mesh(self, mesh: Mesh) -> None:
    """Fails on a rule naming a mesh axis the mesh lacks, before any array is resolved."""
    for rule in self.rules:
      axes = axes_tuple(rule[1])
      for a in axes:
        if a not in mesh.axis_names:
          raise PartitioningError(
              f"rule {rule!r} of rule set {self.name!r} names mesh axis {a!r}, but the mesh has "
              f"only {tuple(mesh.axis_names)}; use one of those or None")
      if len(set(axes)) != len(axes):
        raise PartitioningError(f"rule {rule!r} of rule set {self.name!r} uses a mesh axis twice; "
                                f"list each mesh axis once")

  def without_mesh_axes(self, axes: Iterable[str]) -> "RuleSet":
    """The same rules with `axes` taken out of every rule (a rule left with no axis replicates).

    For code that runs per shard of those axes (inside `shard_map` over them): its activations
    are already split over them, so constraints there may only name the remaining axes.
    """
    drop = set(axes)

    def strip(rule: Rule) -> Rule:
      kept = tuple(a for a in axes_tuple(rule[1]) if a not in drop)
      return (rule[0], None if not kept else kept[0] if len(kept) == 1 else kept)

    return dataclasses.replace(self, rules=tuple(strip(r) for r in self.rules),
                               name=f"{self.name} without {'/'.join(sorted(drop))}")

  def resolve(self, logical: LogicalAxes, shape: Sequence[int], mesh: Mesh,
              path: str = "<array>") -> PartitionSpec:
    """The mesh PartitionSpec of one array, or a PartitioningError naming path, shape and rule."""
    logical = tuple(logical)
    where = f"{path} (shape {tuple(shape)}, logical {logical}, rule set {self.name!r})"
    if len(logical) != len(shape):
      raise PartitioningError(f"{where}: {len(logical)} logical names for a rank-{len(shape)} "
                              f"array; give one logical name (or None) per dimension")
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for dim, (name, size) in enumerate(zip(logical, shape)):
      if name is None:
        spec.append(None)
        continue
      candidates = [r for r in self.rules if r[0] == name]
      if not candidates:
        raise PartitioningError(
            f"{where}: unknown logical axis {name!r} (dim {dim}); add a rule for it, e.g. "
            f"({name!r}, None) to replicate, or use one of {sorted(self.known_names)}")
      chosen: MeshAxes | bool = False
      blocked: list[Rule] = []
      for rule in candidates:
        axes = axes_tuple(rule[1])
        for a in axes:
          if a not in mesh.axis_names:
            raise PartitioningError(
                f"{where}: rule {rule!r} names mesh axis {a!r}, but the mesh has only "
                f"{tuple(mesh.axis_names)}; use one of those or None")
        if len(set(axes)) != len(axes):
          raise PartitioningError(f"{where}: rule {rule!r} uses a mesh axis twice; list each "
                                  f"mesh axis once")
        if any(a in used for a in axes):
          blocked.append(rule)
          continue
        n = math.prod(mesh.shape[a] for a in axes)
        if size % n:
          if self.replicate_indivisible:
            continue
          raise PartitioningError(
              f"{where}: dim {dim} ({name!r}, size {size}) is not divisible by mesh axes {axes} "
              f"(size {n}) under rule {rule!r}; change the mesh shape, add an earlier rule "
              f"({name!r}, None), or set partitioning.replicate_indivisible=True")
        chosen = rule[1]
        used.update(axes)
        break
      if chosen is False:
        # Without replicate_indivisible an indivisible rule already raised, so every candidate
        # here was blocked by an axis taken earlier in this spec.
        if not self.replicate_indivisible:
          taken = sorted({a for r in blocked for a in axes_tuple(r[1])} & used)
          raise PartitioningError(
              f"{where}: mesh axis {taken} would be used twice in one spec by rule "
              f"{blocked[-1]!r} and no fallback is left; add a later fallback rule ({name!r}, "
              f"None) or another free axis")
        chosen = None
      spec.append(chosen)
    return PartitionSpec(*spec)


def rules_from_config(cfg) -> RuleSet:
  """`partitioning.strategy` preset, with `partitioning.rules` prepended (they win)."""
  get = (lambda k, d: cfg.get(k, d)) if hasattr(cfg, "get") else (lambda k, d: getattr(cfg, k, d))
  strategy = get("strategy", "fsdp")
  extra = tuple(get("rules", ()) or ())
  return RuleSet(rules=tuple(extra) + preset(strategy),
                 replicate_indivisible=bool(get("replicate_indivisible", False)),
                 name=strategy if not extra else f"{strategy}+{len(extra)} rules")
