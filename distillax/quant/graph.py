"""Small helpers to address nodes of an NNX module graph by path ('layers', 0, 'attn', 'q')."""

from __future__ import annotations

from typing import Any, Iterable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec


def path_name(path: Iterable[Any]) -> str:
  """'layers/0/attn/q': the names rules and safetensors keys use."""
  return "/".join(str(k) for k in path)


def get_path(root: Any, path: Iterable[Any]) -> Any:
  node = root
  for key in path:
    if isinstance(node, (nnx.List, list, tuple)) or isinstance(key, int):
      node = node[key]
    elif isinstance(node, dict):
      node = node[key]
    else:
      node = getattr(node, key)
  return node


def set_path(root: Any, path: Iterable[Any], value: Any) -> None:
  path = tuple(path)
  parent = get_path(root, path[:-1])
  key = path[-1]
  if isinstance(parent, (nnx.List, list, dict)) or isinstance(key, int):
    parent[key] = value
  else:
    setattr(parent, key, value)


def flat_pure_dict(tree: Any) -> dict[str, Any]:
  """{'layers/0/attn/q': array, ...} from a nested pure dict."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    flat[path_name(getattr(k, "key", getattr(k, "idx", k)) for k in path)] = leaf
  return flat


def derived_sharding(like: Any, axes_map: Iterable[int | None]) -> NamedSharding | None:
  """A NamedSharding whose dim i is sharded like dim axes_map[i] of `like` (None: replicated).

  Adapters and scales inherit the placement of the weight they belong to this way.
  """
  sharding = getattr(like, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return None
  spec = tuple(sharding.spec) + (None,) * (np.ndim(like) - len(sharding.spec))
  return NamedSharding(sharding.mesh, PartitionSpec(*(None if a is None else spec[a]
                                                      for a in axes_map)))


def place_like(value: jax.Array, like: Any, axes_map: Iterable[int | None]) -> jax.Array:
  sharding = derived_sharding(like, axes_map)
  return value if sharding is None else jax.device_put(value, sharding)
