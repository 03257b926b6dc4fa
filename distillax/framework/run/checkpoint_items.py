"""What one checkpoint step holds besides the arrays, and how a restore target is built and checked.

A step directory holds three orbax items, written together and committed atomically:

  state/  the TrainState arrays (orbax StandardCheckpointHandler, OCDBT)
  data/   the data iterator's state, one JSON file per JAX process (each process reads its own
          shard of the data, so each has its own position)
  meta/   a small JSON of run metadata, written by the primary process only

The restore target is a tree of ShapeDtypeStructs carrying the *target* shardings on a concrete
mesh: orbax reads each shard straight into place, so a checkpoint written under one mesh and
partitioning restores under any other. Before reading any array, the saved tree metadata is
compared with the target: a different model or optimizer is the user's mistake and raises, while
an unreadable or incomplete step is corruption and the caller may fall back to an older step.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, Sharding

from distillax.errors import UserError

STATE, DATA, META = "state", "data", "meta"
ITEMS = (STATE, DATA, META)
META_FILENAME = "meta.json"


# tensorstore appends each driver's whole JSON spec to its errors: " [tensorstore_spec='{...}']",
# then " [tensorstore_spec[1]='{...}']" for the next driver, and so on.
_TENSORSTORE_SPEC = re.compile(r" \[tensorstore_spec(\[\d+\])?=")


def short_problem(e: BaseException, limit: int = 400) -> str:
  """One line from an exception, without tensorstore's JSON specs (which help nobody); cut
  where a spec would begin, never inside one, when still too long."""
  text = _TENSORSTORE_SPEC.split(f"{type(e).__name__}: {e}", maxsplit=1)[0].splitlines()[0]
  return text if len(text) <= limit else text[:limit] + " ..."


class CorruptCheckpointError(UserError):
  """A checkpoint step that cannot be read: truncated file, missing item, unreadable metadata."""

  def __init__(self, step: int, directory: str, problem: str):
    self.step, self.directory, self.problem = step, directory, problem
    super().__init__(f"checkpoint step {step} in {directory} is unusable: {problem}; restore an "
                     f"earlier step (Checkpointer.restore_latest_valid does this)")


# ---- per-process JSON item (the data iterator state) ----------------------------------------

def _process_filename(index: int, count: int) -> str:
  return f"process_{index}-of-{count}.json"


class ProcessJsonHandler(ocp.handlers.CheckpointHandler):
  """Each JAX process writes and reads only its own JSON file.

  The data pipeline's state is per process (its shard of the data), so unlike orbax's
  JsonCheckpointHandler (primary host only) every process writes here.
  """

  def save(self, directory: epath.Path, args: "ProcessJsonSave"):
    name = _process_filename(jax.process_index(), jax.process_count())
    (epath.Path(directory) / name).write_text(args.payload)

  def restore(self, directory: epath.Path, args: "ProcessJsonRestore | None" = None):
    directory = epath.Path(directory)
    name = _process_filename(jax.process_index(), jax.process_count())
    path = directory / name
    if not path.exists():
      saved = sorted(p.name for p in directory.glob("process_*.json"))
      if not saved:
        raise FileNotFoundError(f"no data-state file in {directory}")
      return ProcessJsonResult(found=False, value=None, saved_files=tuple(saved))
    return ProcessJsonResult(found=True, value=json.loads(path.read_text()),
                             saved_files=(name,))

  def metadata(self, directory: epath.Path):
    return None

  def finalize(self, directory: epath.Path):
    pass

  def close(self):
    pass


@dataclasses.dataclass(frozen=True)
class ProcessJsonResult:
  found: bool  # False: saved by a different process count (files listed in saved_files)
  value: Any
  saved_files: tuple[str, ...]


@ocp.args.register_with_handler(ProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class ProcessJsonSave(ocp.args.CheckpointArgs):
  payload: str  # already-serialised JSON: serialising early makes a bad value fail at save()


@ocp.args.register_with_handler(ProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class ProcessJsonRestore(ocp.args.CheckpointArgs):
  pass


def to_json(value: Any, what: str) -> str:
  try:
    return json.dumps(value, sort_keys=True, allow_nan=True)
  except (TypeError, ValueError) as e:
    raise UserError(f"{what} is not JSON-serialisable ({e}); pass plain dicts, lists, str, int, "
                    f"float, bool or None (e.g. a grain iterator's get_state())") from e


def handler_registry(primary_host: int | None) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """Explicit handlers, so that the primary host setting reaches every item."""
  mp = ocp.options.MultiprocessingOptions(primary_host=primary_host)
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  state_handler = ocp.handlers.StandardCheckpointHandler(multiprocessing_options=mp)
  registry.add(STATE, ocp.args.StandardSave, state_handler)
  registry.add(STATE, ocp.args.StandardRestore, state_handler)
  meta_handler = ocp.handlers.JsonCheckpointHandler(META_FILENAME, multiprocessing_options=mp)
  registry.add(META, ocp.args.JsonSave, meta_handler)
  registry.add(META, ocp.args.JsonRestore, meta_handler)
  data_handler = ProcessJsonHandler()
  registry.add(DATA, ProcessJsonSave, data_handler)
  registry.add(DATA, ProcessJsonRestore, data_handler)
  return registry


# ---- restore targets -------------------------------------------------------------------------

def concrete_sharding(sharding: Sharding) -> Sharding:
  """A NamedSharding on an AbstractMesh (what `nnx.eval_shape` under `jax.set_mesh` gives) is
  rebuilt on the active concrete mesh; orbax needs real devices to place shards."""
  if not (isinstance(sharding, NamedSharding)
          and isinstance(sharding.mesh, jax.sharding.AbstractMesh)):
    return sharding
  mesh = jax.sharding.get_mesh()
  if mesh.empty or mesh.abstract_mesh != sharding.mesh:
    raise UserError(
        f"restore target sharding {sharding.spec} is on an AbstractMesh "
        f"{dict(sharding.mesh.shape)} with no matching concrete mesh active; pass NamedShardings "
        f"on a real Mesh (e.g. build_layout(..., mesh=mesh).shardings) or restore inside "
        f"`with jax.set_mesh(mesh):`")
  return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def restore_target(abstract_state: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs with the target shardings attached.

  `shardings` is a tree shaped like `abstract_state` (e.g. `StateLayout.shardings`), a single
  Sharding for every leaf (`SingleDeviceSharding(jax.devices()[0])` restores onto one device),
  or None to use the shardings already on the abstract leaves.
  """
  def leaf(a, s):
    s = s if s is not None else getattr(a, "sharding", None)
    if s is None:
      raise UserError(f"no target sharding for a leaf of shape {a.shape}; pass shardings= (a "
                      f"tree like the state, or one Sharding for all leaves)")
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=concrete_sharding(s))

  if shardings is None or isinstance(shardings, Sharding):
    return jax.tree.map(lambda a: leaf(a, shardings), abstract_state)
  return jax.tree.map(leaf, abstract_state, shardings)


def check_step_items(step_dir: epath.Path, step: int) -> None:
  """Every item directory is present (orbax only notices a missing item when restoring it)."""
  if not step_dir.is_dir():
    raise CorruptCheckpointError(step, str(step_dir.parent), f"{step_dir} is not a directory")
  for item in ITEMS:
    if not (step_dir / item).is_dir():
      raise CorruptCheckpointError(step, str(step_dir.parent),
                                   f"item '{item}' is missing ({step_dir / item})")


def check_saved_tree(step_dir: epath.Path, step: int, target: Any) -> None:
  """Saved array names, shapes against the target: corruption vs a different model."""
  try:
    saved = ocp.handlers.StandardCheckpointHandler().metadata(step_dir / STATE)
  except Exception as e:  # noqa: BLE001 - any read/parse failure of the metadata is corruption
    raise CorruptCheckpointError(step, str(step_dir.parent),
                                 f"unreadable tree metadata ({short_problem(e)})") from e
  saved_tree = getattr(saved, "tree", saved)
  have = {m.name: tuple(m.shape) for m in jax.tree.leaves(saved_tree) if hasattr(m, "shape")}
  names = jax.tree.leaves(ocp.tree.get_param_names(target, include_empty_nodes=False))
  assert len(names) == len(jax.tree.leaves(target))
  want = {n: tuple(t.shape) for n, t in zip(names, jax.tree.leaves(target))}
  missing = sorted(set(want) - set(have))
  unexpected = sorted(set(have) - set(want))
  reshaped = sorted(f"{n} {have[n]} != {want[n]}" for n in set(want) & set(have)
                    if have[n] != want[n])
  if missing or unexpected or reshaped:
    parts = [f"{label}: {', '.join(xs[:4])}{' ...' if len(xs) > 4 else ''}"
             for label, xs in (("missing in checkpoint", missing),
                               ("not in the model", unexpected),
                               ("shape (saved != model)", reshaped)) if xs]
    raise UserError(f"checkpoint step {step} in {step_dir.parent} was saved by a different model "
                    f"or optimizer ({'; '.join(parts)}); restore with the config that wrote it or "
                    f"use a new workdir")
