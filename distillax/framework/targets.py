"""Compile targets for `plan --target`: a TPU slice or a GPU cluster described by name, and the
compile-only devices of its real compiler on this (CPU-only) host.

JAX compiles ahead of time for a device topology it is not running on: libtpu describes any TPU
slice (`jax.experimental.topologies.get_topology_desc(platform='tpu')`), the CUDA plugin any set
of GPUs given an XLA GPU target config. A mesh over those devices lowers and compiles the job's
real step with the target's compiler (Mosaic kernels, TPU tiling, GPU fusions included); nothing
runs. Names follow the clouds' own: `tpu:v5p-128` counts TensorCores as gcloud does (v4 and v5p
have two per chip, JAX sees one device per chip), `tpu:v5e-256` chips; `gpu:h100x8` is one node
of 8 GPUs, `--nodes` multiplies it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re

from distillax.errors import UserError

GIB = 2**30
# What `pip install` line brings each platform's compiler in (pyproject's extras).
EXTRA = {"tpu": "aot", "gpu": "aot-gpu"}


@dataclasses.dataclass(frozen=True)
class TpuChip:
  topology: str  # libtpu's name of the generation in a topology string
  hbm_gib: float  # per JAX device
  cores_per_chip: int  # TensorCores a gcloud accelerator name counts per chip
  devices_per_chip: int  # JAX devices per chip (megacore chips are one device)
  dims: int  # 2 (a torus of v5e/v6e chips) or 3


TPU_CHIPS = {
    "v4": TpuChip("v4", 32, 2, 1, 3),
    "v5e": TpuChip("v5e", 16, 1, 1, 2),
    "v5p": TpuChip("v5p", 95, 2, 1, 3),
    "v6e": TpuChip("v6e", 32, 1, 1, 2),
    "tpu7x": TpuChip("tpu7x", 96, 2, 2, 3),
}


def _gpu_config(name: str, sms: int, memory_bytes: int, bandwidth: float, l2_mib: int,
                major: int) -> str:
  """An XLA GPU target config (what the CUDA plugin compiles for with no GPU attached), from
  the chip's public figures."""
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(bandwidth)}
  l2_cache_size: {l2_mib * 2**20}
  clock_rate_ghz: 1.98
  device_memory_size: {memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
runtime_version {{ major: 12 minor: 8 }}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{name}"
"""


@dataclasses.dataclass(frozen=True)
class GpuChip:
  description: str
  memory_bytes: int
  sms: int
  bandwidth: float  # bytes/s
  l2_mib: int
  compute_major: int

  @property
  def target_config(self) -> str:
    return _gpu_config(self.description, self.sms, self.memory_bytes, self.bandwidth,
                       self.l2_mib, self.compute_major)


GPU_CHIPS = {
    "h100": GpuChip("NVIDIA H100 80GB HBM3", 80 * 10**9, 132, 3.35e12, 50, 9),
    "h200": GpuChip("NVIDIA H200", 141 * 10**9, 132, 4.8e12, 50, 9),
    "b200": GpuChip("NVIDIA B200", 180 * 10**9, 148, 8.0e12, 126, 10),
}


@dataclasses.dataclass(frozen=True)
class Target:
  """One compile target: `name` as typed, its platform, chip, device count and topology."""

  name: str
  platform: str  # 'tpu' | 'gpu'
  chip: str
  devices: int  # JAX devices the mesh spans
  topology: str  # libtpu's topology of one slice ('v5p:4x4x4'), or the GPU '1xNxG'
  memory_bytes: int  # per device
  slices: int = 1

  def describe(self) -> str:
    where = (f"{self.slices} slices of {self.topology}" if self.slices > 1 else self.topology)
    return (f"{self.name}: {self.devices} {self.chip} devices ({where}), "
            f"{self.memory_bytes / GIB:.1f} GiB each")


_TPU_RE = re.compile(r"^tpu:([a-z0-9]+)-(\d+)$")
_GPU_RE = re.compile(r"^gpu:([a-z0-9]+)x(\d+)$")


def _tpu_shape(chips: int, dims: int) -> tuple[int, ...] | None:
  """The usual slice shape of `chips` chips: a square-ish 2D torus or 3D cube, the long axes
  last and unit axes at the end (v5e-32 is 4x8, v5p-8's 4 chips 2x2x1, v5p-128's 4x4x4)."""
  if chips < 1 or chips & (chips - 1):
    return None
  shape = [1] * dims
  for i in range(int(math.log2(chips))):
    shape[dims - 1 - (i % dims)] *= 2
  grown = sorted(d for d in shape if d > 1)  # hosts hold 2x2x1 chips: the 1s go last
  return tuple(grown + [1] * (dims - len(grown)))


def _examples() -> str:
  return "e.g. tpu:v5e-4, tpu:v5p-128, tpu:v6e-64, tpu:v4-32, tpu:tpu7x-16, gpu:h100x8"


def _tpu_target(spec: str, generation: str, count: int, slices: int) -> Target:
  chip = TPU_CHIPS.get(generation)
  if chip is None:
    raise UserError(f"--target={spec}: no TPU generation {generation!r}; use one of "
                    f"{', '.join(TPU_CHIPS)} ({_examples()})")
  chips = count // chip.cores_per_chip
  shape = _tpu_shape(chips, chip.dims) if count % chip.cores_per_chip == 0 else None
  if shape is None:
    unit = "TensorCores, 2 per chip" if chip.cores_per_chip == 2 else "chips"
    raise UserError(f"--target={spec}: {count} {unit} is not a slice of {generation}; use a "
                    f"power of two, e.g. tpu:{generation}-{4 * chip.cores_per_chip}")
  topology = f"{chip.topology}:{'x'.join(map(str, shape))}"
  devices = chips * chip.devices_per_chip * slices
  return Target(spec, "tpu", generation, devices, topology, int(chip.hbm_gib * GIB), slices)


def parse_target(spec: str, *, slices: int | None = None, nodes: int | None = None) -> Target:
  """The Target a `--target` value names; a UserError with examples for anything else."""
  spec = spec.strip().lower()
  for flag, value in (("slices", slices), ("nodes", nodes)):
    if value is not None and value < 1:
      raise UserError(f"--{flag}={value} must be a positive whole number, e.g. --{flag} 2")
  if (m := _TPU_RE.match(spec)):
    if nodes is not None:
      raise UserError(f"--nodes is for GPU targets; a TPU target spans slices: "
                      f"--target {spec} --slices {nodes}")
    return _tpu_target(spec, m.group(1), int(m.group(2)), slices or 1)
  if (m := _GPU_RE.match(spec)):
    chip = GPU_CHIPS.get(m.group(1))
    per_node = int(m.group(2))
    if chip is None or per_node < 1:
      raise UserError(f"--target={spec}: no GPU {m.group(1)!r}x{per_node}; use one of "
                      f"{', '.join(f'gpu:{g}x8' for g in GPU_CHIPS)} (GPUs per node)")
    if slices is not None:
      raise UserError(f"--slices is for TPU targets; a GPU target spans nodes: "
                      f"--target {spec} --nodes {slices}")
    n = nodes or 1
    return Target(spec, "gpu", m.group(1), n * per_node, f"1x{n}x{per_node}", chip.memory_bytes)
  raise UserError(f"--target={spec} is not a target; write tpu:<generation>-<size> or "
                  f"gpu:<chip>x<GPUs per node> ({_examples()})")


def _missing(target: Target, what: str) -> UserError:
  return UserError(f"--target={target.name} compiles with {what}, which is not installed; "
                   f"install the {EXTRA[target.platform]!r} extra: pip install "
                   f"'distillax[{EXTRA[target.platform]}]'")


def installed(module: str) -> bool:
  """Whether `module` can be imported (a compiler's package), without importing it."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is missing
    return False


def target_devices(target: Target) -> list:
  """The compile-only devices of `target` (no accelerator needed)."""
  from jax.experimental import topologies
  if target.platform == "tpu":
    if not installed("libtpu"):
      raise _missing(target, "libtpu (the TPU compiler)")
    shape = tuple(int(d) for d in target.topology.split(":")[1].split("x"))
    # Hosts of 2x2 chips; a slice smaller than one host is its own host.
    host = (2, 2, 1) if math.prod(shape) >= 4 else (shape + (1, 1))[:3]
    devices = topologies.get_topology_desc(
        topology_name=target.topology, platform="tpu",
        chip_config_name="megacore" if target.chip == "v4" else "default",
        chips_per_host_bounds=host, num_slices=target.slices, wrap=(False, False, False)).devices
  else:
    if not installed("jax_plugins.xla_cuda12"):
      raise _missing(target, "the CUDA PJRT plugin (jax-cuda12-plugin, jax-cuda12-pjrt)")
    devices = topologies.get_topology_desc(
        platform="cuda", topology=target.topology,
        target_config=GPU_CHIPS[target.chip].target_config).devices
  if len(devices) != target.devices:
    raise ValueError(f"{target.name}: the compiler describes {len(devices)} devices, "
                     f"expected {target.devices}")
  return list(devices)
