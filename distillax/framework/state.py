"""Train state as plain pytrees, and its sharded initialisation.

The state holds arrays only (pure dicts, as `nnx.to_pure_dict` gives them); the modules' static
structure (GraphDefs) lives beside it in `ModelDefs` and the step rebuilds modules with
`nnx.merge`. Plain trees are what orbax, optax, `shard_map`, `pmap` and `vmap` all handle alike.

`trainable` and `frozen` split one model: the student's trainable parameters (by a filter: all
`nnx.Param` by default, only LoRA adapters under LoRA) go to the optimizer, everything else of the
student and every extra model (a teacher) is frozen and never updated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distillax import partitioning as pt

STUDENT = "student"


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # trainable parameters of the student (pure dict)
  frozen: Any  # {"student": rest of the student, "<name>": extra frozen models}
  opt_state: Any  # optax state over `params` (fp32 by default)
  rng: jax.Array  # uint32[2] raw key data: checkpointable as a plain array


@dataclasses.dataclass(frozen=True)
class ModelDefs:
  """The static halves of the models the step merges: hashable, closed over by the step."""

  student: nnx.GraphDef
  extras: tuple[tuple[str, nnx.GraphDef], ...] = ()

  def merge(self, params, frozen) -> tuple[nnx.Module, dict[str, nnx.Module]]:
    student = nnx.merge(self.student, params, frozen[STUDENT])
    return student, {name: nnx.merge(g, frozen[name]) for name, g in self.extras}


def split_model(model: nnx.Module, trainable: Any = nnx.Param):
  """(graphdef, trainable pure dict, frozen pure dict, their logical specs)."""
  graph, train_state, rest_state = nnx.split(model, trainable, ...)
  return (graph, nnx.to_pure_dict(train_state), nnx.to_pure_dict(rest_state),
          pt.logical_tree(train_state), pt.logical_tree(rest_state))


def _subtree(tree: dict, path: tuple):
  """The subtree at `path`; {} where the path is absent (a pure dict leaves out what is empty)."""
  for key in path:
    tree = tree.get(key, {})
  return tree


def _replaced(tree: dict, path: tuple, value):
  """`tree` with the subtree at `path` replaced by `value` (None: removed); `tree` is unchanged."""
  if not value:  # an empty subtree is no subtree: pure dicts leave empty modules out
    value = None
  if not path:
    return {} if value is None else value
  out = dict(tree)
  if len(path) == 1 and value is None:
    out.pop(path[0], None)
  elif value is not None or path[0] in out:
    out[path[0]] = _replaced(tree.get(path[0], {}), path[1:], value)
  return out


@dataclasses.dataclass(frozen=True)
class Reloaded:
  """The frozen models a checkpoint leaves out because the run reloads them from their source
  (a teacher, a LoRA base): they never change during training, and storing them would write a
  teacher's full size into every checkpoint. What the run changes (trainable parameters, the
  student's own frozen parts, optimizer state, RNG, step) is what a checkpoint holds.

  extras: names of frozen extra models reloaded whole; student_base: where the student's
  source model sits in its frozen tree (() for a bare model), None when all of it is stored.
  """

  extras: tuple[str, ...] = ()
  student_base: tuple | None = None

  def stored(self, state: TrainState) -> TrainState:
    """The part of `state` (or of its abstract/sharding tree) that a checkpoint holds."""
    frozen = {k: v for k, v in state.frozen.items() if k not in self.extras}
    if self.student_base is not None:
      frozen[STUDENT] = _replaced(frozen[STUDENT], self.student_base, None)
    return state.replace(frozen=frozen)

  def joined(self, stored: TrainState, frozen: dict) -> TrainState:
    """A whole state from a restored `stored` one and `frozen`, the frozen tree of the models
    rebuilt from their sources."""
    whole = dict(frozen)
    if self.student_base is not None:
      base = _subtree(frozen[STUDENT], self.student_base)
      whole[STUDENT] = _replaced(stored.frozen[STUDENT], self.student_base, base)
    else:
      whole[STUDENT] = stored.frozen[STUDENT]
    return stored.replace(frozen=whole)

  def reloads_student(self, abstract: TrainState) -> bool:
    """Whether any array of the student is reloaded rather than stored (its source matters)."""
    if self.student_base is None:
      return False
    return bool(jax.tree.leaves(_subtree(abstract.frozen[STUDENT], self.student_base)))


@dataclasses.dataclass
class StateLayout:
  """Everything needed to build, shard and step a TrainState, except the arrays' values."""

  defs: ModelDefs
  abstract: TrainState  # ShapeDtypeStructs
  logical: TrainState  # logical PartitionSpecs of params and frozen (opt_state: None)
  trainable: Any = nnx.Param  # the nnx filter that chose the student's trainable parameters
  shardings: TrainState | None = None  # NamedShardings, when built for a mesh
  reloaded: Reloaded = Reloaded()  # what checkpoints leave out (reloaded from sources)

  @property
  def stored_abstract(self) -> TrainState:
    """The abstract state a checkpoint holds (restore target shapes)."""
    return self.reloaded.stored(self.abstract)

  @property
  def stored_shardings(self) -> TrainState | None:
    return None if self.shardings is None else self.reloaded.stored(self.shardings)


def _fp32(x):
  return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def master_dtype_params(params):
  """Gradients and optimizer state live in fp32 whatever the parameters' storage dtype."""
  return jax.tree.map(_fp32, params)


def build_layout(student: nnx.Module, extras: Mapping[str, nnx.Module],
                 tx: optax.GradientTransformation, mesh: Mesh | None, rules: pt.RuleSet | None,
                 trainable: Any = nnx.Param, reloaded: Reloaded = Reloaded()) -> StateLayout:
  """Layout of the state for abstract or real modules (shapes only are read)."""
  s_graph, s_train, s_rest, s_train_lg, s_rest_lg = split_model(student, trainable)
  extra_graphs, frozen, frozen_lg = [], {STUDENT: s_rest}, {STUDENT: s_rest_lg}
  for name, m in extras.items():
    g, st = nnx.split(m)
    extra_graphs.append((name, g))
    frozen[name], frozen_lg[name] = nnx.to_pure_dict(st), pt.logical_tree(st)
  shape = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  abstract_params = shape(s_train)
  abstract_opt = jax.eval_shape(lambda p: tx.init(master_dtype_params(p)), abstract_params)
  abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                        frozen=shape(frozen), opt_state=abstract_opt,
                        rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
  logical = TrainState(step=P(), params=s_train_lg, frozen=frozen_lg, opt_state=None, rng=P())
  layout = StateLayout(ModelDefs(s_graph, tuple(extra_graphs)), abstract, logical, trainable,
                       reloaded=reloaded)
  if mesh is not None:
    layout.shardings = state_shardings(layout, tx, mesh, rules)
  return layout


def state_shardings(layout: StateLayout, tx, mesh: Mesh, rules: pt.RuleSet) -> TrainState:
  rep = NamedSharding(mesh, P())
  a, lg = layout.abstract, layout.logical
  params = pt.tree_shardings(a.params, lg.params, mesh, rules)
  return TrainState(step=rep, params=params,
                    frozen=pt.tree_shardings(a.frozen, lg.frozen, mesh, rules),
                    opt_state=pt.optimizer_shardings(tx, a.opt_state, params, mesh), rng=rep)


def frozen_tree(student: nnx.Module, extras: Mapping[str, nnx.Module], layout: StateLayout):
  """The frozen tree of real modules: the student's untrained part and every extra model."""
  _, _, s_rest, _, _ = split_model(student, layout.trainable)
  return {STUDENT: s_rest, **{n: nnx.to_pure_dict(nnx.state(m)) for n, m in extras.items()}}


def init_state(student: nnx.Module, extras: Mapping[str, nnx.Module], tx, layout: StateLayout,
               seed: int) -> TrainState:
  """Real state from real (already sharded) modules; optimizer state created in place."""
  _, s_train, _, _, _ = split_model(student, layout.trainable)
  frozen = frozen_tree(student, extras, layout)
  sh = layout.shardings
  opt_init = jax.jit(lambda p: tx.init(master_dtype_params(p)),
                     out_shardings=sh.opt_state if sh is not None else None)
  rng = jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=s_train, frozen=frozen,
                     opt_state=opt_init(s_train), rng=rng)
  if sh is not None:
    state = jax.device_put(state, sh)
  return state


def param_count(tree) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(tree))

