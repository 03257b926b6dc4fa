"""Shardings for whole trees, activation constraints, and the human-readable sharding plan.

Models store each parameter's logical axes as nnx Variable metadata under `logical_axes`.
Everything here works on plain pytrees: a tree of arrays (or ShapeDtypeStructs) and a tree of the
same structure whose leaves are PartitionSpecs of *logical* names. `logical_tree` pulls that tree
out of an nnx State; optimizer state borrows its parameters' shardings via `optax.tree_map_params`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Iterable, Sequence

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from distillax.errors import PartitioningError
from distillax.partitioning.rules import RuleSet, axes_tuple

LOGICAL_AXES_KEY = "logical_axes"


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def path_str(path) -> str:
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    else:
      parts.append(str(k).strip(".[]'"))
  return "/".join(parts)


def logical_tree(state) -> Any:
  """Pure-dict tree of logical PartitionSpecs from an nnx State/Module (Variables' metadata).

  A Variable without `logical_axes` is an error: every parameter must name its dims, otherwise
  it would silently be replicated.
  """
  if isinstance(state, nnx.Module):
    state = nnx.state(state)

  def spec(path, v):
    axes = v.get_metadata().get(LOGICAL_AXES_KEY)
    if axes is None:
      if np.ndim(v.get_value()) == 0:
        return PartitionSpec()
      raise PartitioningError(f"{path_str(path)} (shape {np.shape(v.get_value())}) has no "
                              f"logical axes; create it with nnx.Param(..., logical_axes=(...))")
    return PartitionSpec(*axes)

  tree = jax.tree_util.tree_map_with_path(spec, state, is_leaf=_is_variable)
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def pure_values(state) -> Any:
  """The arrays of an nnx State/Module as a plain nested dict (the layout of train state)."""
  if isinstance(state, nnx.Module):
    state = nnx.state(state)
  return nnx.to_pure_dict(state)


def tree_specs(tree, logical, mesh: Mesh, rules: RuleSet) -> Any:
  """Mesh PartitionSpecs for every leaf of `tree`, resolved from `logical` under `rules`."""
  rules.check_mesh(mesh)
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  logical_leaves = treedef.flatten_up_to(logical)
  specs = [rules.resolve(tuple(lg), np.shape(x), mesh, path_str(p))
           for (p, x), lg in zip(flat, logical_leaves)]
  return jax.tree_util.tree_unflatten(treedef, specs)


def tree_shardings(tree, logical, mesh: Mesh, rules: RuleSet) -> Any:
  """NamedShardings for every leaf of `tree` (arrays or ShapeDtypeStructs)."""
  specs = tree_specs(tree, logical, mesh, rules)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def optimizer_shardings(tx: optax.GradientTransformation, abstract_opt_state, param_shardings,
                        mesh: Mesh) -> Any:
  """Optimizer state mirrors its parameters' shardings; scalars (step counts) are replicated.

  `jax.jit(tx.init)` alone would leave Adam moments replicated, so they are named explicitly.
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  return optax.tree_map_params(tx, lambda _, s: s, abstract_opt_state, param_shardings,
                               transform_non_params=lambda _: replicated)


# ---- activation constraints --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ActiveRules:
  mesh: Mesh | jax.sharding.AbstractMesh
  rules: RuleSet


_ACTIVE: contextvars.ContextVar[ActiveRules | None] = contextvars.ContextVar(
    "distillax_active_rules", default=None)


def active_rules() -> ActiveRules | None:
  """The mesh and rules of the innermost `use_rules` (None outside, or under `no_rules`): for
  code that lays out more than one activation from the same rules (adapter matmuls)."""
  return _ACTIVE.get()


@contextlib.contextmanager
def use_rules(mesh: Mesh | jax.sharding.AbstractMesh, rules: RuleSet):
  """Activates `constrain` for code traced inside (the GSPMD `jit` path).

  Inside `shard_map` over some axes, pass `jax.sharding.get_abstract_mesh()` (which marks them
  manual) and rules `without_mesh_axes` those axes.

  Outside this context (shard_map, pmap, vmap backends, plain eager use) `constrain` is the
  identity, so the same model code runs under every backend.
  """
  token = _ACTIVE.set(ActiveRules(mesh, rules))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


@contextlib.contextmanager
def no_rules():
  """Turns activation constraints off inside (e.g. per-device code under shard_map)."""
  token = _ACTIVE.set(None)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


@dataclasses.dataclass(frozen=True)
class ManualAxes:
  """Where the active rules split one logical axis: the mesh and its axes, for code that runs a
  `shard_map` region over exactly them (the rest of the mesh stays under GSPMD)."""

  mesh: Mesh | jax.sharding.AbstractMesh
  axes: tuple[str, ...]  # mesh axes, major first
  size: int  # number of shards (the product of their sizes)
  inner_rules: RuleSet  # the active rules without these axes, for constraints inside the region


def split_over(logical: str, size: int) -> ManualAxes | None:
  """The mesh axes the active rules split a dimension named `logical` of length `size` over;
  None outside `use_rules`, or when they keep it whole (replicated, or on axes of one device).

  Why: a model whose parallel form needs explicit collectives (the experts' token exchange)
  asks the rules whether to build it, and never reads the mesh itself."""
  active = _ACTIVE.get()
  if active is None:
    return None
  spec = active.rules.resolve((logical,), (size,), active.mesh, logical)
  axes = axes_tuple(spec[0]) if len(spec) else ()
  shards = math.prod(active.mesh.shape[a] for a in axes)
  if shards <= 1:
    return None
  return ManualAxes(active.mesh, axes, shards, active.rules.without_mesh_axes(axes))


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical names under the active rules; identity otherwise."""
  active = _ACTIVE.get()
  if active is None:
    return x
  spec = active.rules.resolve(tuple(logical), x.shape, active.mesh, "activation")
  return jax.lax.with_sharding_constraint(x, NamedSharding(active.mesh, spec))


# ---- the plan: describe and sufficiency ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlanRow:
  path: str
  shape: tuple[int, ...]
  dtype: str
  logical: tuple[str | None, ...]
  mesh_spec: tuple[Any, ...]
  bytes_total: int
  bytes_per_device: int

  @property
  def replicated(self) -> bool:
    return all(a is None for a in self.mesh_spec)


def describe(tree, logical, mesh: Mesh, rules: RuleSet) -> list[PlanRow]:
  """One row per leaf: where it lives and what each device holds of it."""
  shardings = tree_shardings(tree, logical, mesh, rules)
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  logical_leaves = treedef.flatten_up_to(logical)
  sharding_leaves = treedef.flatten_up_to(shardings)
  rows = []
  for (path, x), lg, sh in zip(flat, logical_leaves, sharding_leaves):
    shape = tuple(int(d) for d in np.shape(x))
    itemsize = np.dtype(x.dtype).itemsize
    rows.append(PlanRow(
        path=path_str(path), shape=shape, dtype=str(np.dtype(x.dtype)), logical=tuple(lg),
        mesh_spec=tuple(sh.spec) + (None,) * (len(shape) - len(sh.spec)),
        bytes_total=math.prod(shape) * itemsize,
        bytes_per_device=math.prod(sh.shard_shape(shape)) * itemsize))
  return rows


def format_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} TiB"


def _fmt_spec(spec: Iterable[Any]) -> str:
  def one(a):
    if a is None:
      return "-"
    return "+".join(a) if isinstance(a, tuple) else str(a)
  return "(" + ", ".join(one(a) for a in spec) + ")"


def format_plan(rows: Sequence[PlanRow], title: str = "") -> str:
  """A fixed-width table, with totals: what a user reads before launching a pod run."""
  head = ("path", "shape", "dtype", "logical", "mesh", "bytes/device")
  body = [(r.path, "x".join(map(str, r.shape)) or "scalar", r.dtype, _fmt_spec(r.logical),
           _fmt_spec(r.mesh_spec), format_bytes(r.bytes_per_device)) for r in rows]
  widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
            for i, h in enumerate(head)]
  line = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()
  total = sum(r.bytes_total for r in rows)
  per_dev = sum(r.bytes_per_device for r in rows)
  out = [title] if title else []
  out += [line(head), line(["-" * w for w in widths])] + [line(b) for b in body]
  out.append(f"total {format_bytes(total)}; per device {format_bytes(per_dev)} "
             f"({per_dev / total:.3f} of total)" if total else "empty tree")
  return "\n".join(out)


@dataclasses.dataclass(frozen=True)
class Sufficiency:
  replicated_fraction: float
  max_fraction: float
  offenders: tuple[PlanRow, ...]

  @property
  def ok(self) -> bool:
    return self.replicated_fraction <= self.max_fraction


def check_sufficiency(rows: Sequence[PlanRow], max_replicated_fraction: float = 0.05,
                      top: int = 5, raise_on_failure: bool = True) -> Sufficiency:
  """Fails when a sharded preset leaves too many parameter bytes replicated on every device."""
  total = sum(r.bytes_total for r in rows) or 1
  replicated = [r for r in rows if r.replicated]
  frac = sum(r.bytes_total for r in replicated) / total
  offenders = tuple(sorted(replicated, key=lambda r: -r.bytes_total)[:top])
  result = Sufficiency(frac, max_replicated_fraction, offenders)
  if raise_on_failure and not result.ok:
    listing = ", ".join(f"{r.path} {r.shape} {format_bytes(r.bytes_total)}" for r in offenders)
    raise PartitioningError(
        f"{frac:.1%} of parameter bytes are replicated on every device (limit "
        f"{max_replicated_fraction:.0%}); largest: {listing}. Add rules that shard their logical "
        f"axes or raise the limit")
  return result
