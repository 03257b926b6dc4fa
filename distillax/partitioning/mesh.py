"""The ('data', 'model') device mesh, built from config.

Axis types are always passed explicitly: `jax.make_mesh` defaults to Explicit axes today, while
the rules path relies on GSPMD propagation (Auto). Multi-slice pods get a hybrid mesh so that the
`model` axis (tensor parallelism, chatty) stays inside a slice on ICI and only `data` crosses DCN.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from distillax.errors import ConfigError

AXES = ("data", "model")


def resolve_axis_sizes(data: int, model: int, num_devices: int, *, simulable: bool = False
                       ) -> tuple[int, int]:
  """Fills a -1 axis with what is left and checks the product against the device count.
  `simulable`: the devices are CPU devices, whose count `--devices N` sets, so a mesh larger
  than them is best run as the config lays it out, on N simulated devices."""
  sizes = [int(data), int(model)]
  if sizes.count(-1) > 1:
    raise ConfigError(
        f"mesh.data={data} and mesh.model={model}: at most one axis may be -1 (auto-fill); "
        f"set one of them to a number, e.g. --config.mesh.model=1")
  for name, s in zip(AXES, sizes):
    if s == 0 or s < -1:
      raise ConfigError(f"mesh.{name}={s} is not a valid axis size; use a positive integer or -1")
  if -1 in sizes:
    i = sizes.index(-1)
    other = sizes[1 - i]
    if num_devices % other:
      raise ConfigError(
          f"mesh.{AXES[1 - i]}={other} does not divide the {num_devices} available devices, so "
          f"mesh.{AXES[i]}=-1 cannot be filled; pick a divisor of {num_devices}")
    sizes[i] = num_devices // other
  if math.prod(sizes) > num_devices and simulable:
    raise ConfigError(
        f"mesh {sizes[0]}x{sizes[1]} (data x model) needs {math.prod(sizes)} devices but "
        f"{num_devices} are available; on this CPU host add --devices {math.prod(sizes)} "
        f"({math.prod(sizes)} simulated CPU devices: the layout the config sets), or set "
        f"--config.mesh.data and --config.mesh.model so their product is {num_devices}")
  if math.prod(sizes) != num_devices:
    hint = ("fewer devices than the mesh needs" if math.prod(sizes) > num_devices
            else "devices left unused")
    raise ConfigError(
        f"mesh {sizes[0]}x{sizes[1]} (data x model) needs {math.prod(sizes)} devices but "
        f"{num_devices} are available ({hint}); set --config.mesh.data and --config.mesh.model so "
        f"their product is {num_devices}, or use -1 for one of them")
  return sizes[0], sizes[1]


def create_mesh(mesh_config=None, *, devices: Sequence[jax.Device] | None = None,
                axis_type: AxisType = AxisType.Auto) -> Mesh:
  """Builds the Mesh from a config with fields data, model and optional dcn_data, dcn_model.

  With DCN sizes > 1 the per-slice (ICI) shape is (data, model) and the full mesh is
  (data * dcn_data, model * dcn_model), laid out by `create_hybrid_device_mesh`.
  """
  cfg = mesh_config if mesh_config is not None else {}
  get = (lambda k, d: cfg.get(k, d)) if hasattr(cfg, "get") else (lambda k, d: getattr(cfg, k, d))
  devices = list(devices) if devices is not None else jax.devices()
  dcn = (int(get("dcn_data", 1) or 1), int(get("dcn_model", 1) or 1))
  n_slices = dcn[0] * dcn[1]
  if len(devices) % n_slices:
    raise ConfigError(
        f"mesh.dcn_data x mesh.dcn_model = {n_slices} slices does not divide the {len(devices)} "
        f"devices; set them to the number of slices in your pod")
  per_slice = len(devices) // n_slices
  data, model = resolve_axis_sizes(get("data", -1), get("model", 1), per_slice,
                                   simulable=n_slices == 1 and devices[0].platform == "cpu")
  axis_types = (axis_type,) * len(AXES)
  if n_slices == 1:
    try:
      dev_array = mesh_utils.create_device_mesh((data, model), devices=devices)
    except (ValueError, AssertionError, NotImplementedError):
      dev_array = np.asarray(devices).reshape(data, model)
  else:
    dev_array = _hybrid_device_array((data, model), dcn, devices)
  return Mesh(dev_array, AXES, axis_types=axis_types)


def _hybrid_device_array(ici: tuple[int, int], dcn: tuple[int, int],
                         devices: list[jax.Device]) -> np.ndarray:
  """(dcn_data*data, dcn_model*model) devices; each slice fills one (data, model) block.

  Real pods: slices come from `slice_index` (TPU) or from processes (GPU hosts). Simulated CPU
  devices have neither, so contiguous blocks stand in for slices: that keeps the layout testable
  on a laptop with the same block structure a pod gets.
  """
  if hasattr(devices[0], "slice_index"):
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices,
                                                allow_split_physical_axes=True)
  if jax.process_count() > 1:
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices,
                                                process_is_granule=True,
                                                allow_split_physical_axes=True)
  per_slice = ici[0] * ici[1]
  out = np.empty((dcn[0] * ici[0], dcn[1] * ici[1]), dtype=object)
  for s in range(dcn[0] * dcn[1]):
    i, j = divmod(s, dcn[1])
    block = np.asarray(devices[s * per_slice:(s + 1) * per_slice], dtype=object).reshape(ici)
    out[i * ici[0]:(i + 1) * ici[0], j * ici[1]:(j + 1) * ici[1]] = block
  return out


def mesh_shape_str(mesh: Mesh) -> str:
  return "x".join(str(mesh.shape[a]) for a in mesh.axis_names)
