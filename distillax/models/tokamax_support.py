"""What every use of tokamax (openxla's Pallas kernel library, the optional `tokamax` extra)
needs: importing it with its absl flags parsed, and tracing its kernels for the devices the
step compiles for rather than the host's.

Why the device: tokamax asks JAX's default device whether a kernel runs there and what it is
(`supported_on`, the GPU's compute capability, the TPU's generation). A deviceless compile
(`plan --target` from a CPU host) has a CPU default device, so tokamax would refuse its GPU and
TPU kernels, or pick by the CPU. `traced_on` sets the target's device as the default while a
kernel's forward and backward pass are traced; the backward is traced after the call returns,
hence a custom VJP around it.
"""

from __future__ import annotations

import sys

import jax

from distillax.errors import ConfigError
from distillax.partitioning import active_rules


def tokamax_installed() -> bool:
  try:
    import tokamax  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    return False
  return True


def import_tokamax(missing: str):
  """The tokamax module, or ConfigError(missing). tokamax reads its options from absl flags and
  parses sys.argv for them when nobody has: a pytest or a script's own command line then fails
  ("Unknown command line flag 'q'"). Parse an empty one instead (every flag keeps its default);
  the CLI has parsed them already."""
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ConfigError(missing) from None
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(sys.argv[:1] or ["distillax"])
  return tokamax


def target_device():
  """A device of the mesh the step compiles for when it is not of this host's platform (a
  deviceless target compile), else None (the default device is right)."""
  active = active_rules()
  mesh = active.mesh if active is not None else None
  if not isinstance(mesh, jax.sharding.Mesh) or not mesh.devices.size:
    return None
  device = mesh.devices.flat[0]
  host = jax.default_backend()
  same = device.platform == host or (device.platform in ("cuda", "rocm") and host == "gpu")
  return None if same else device


def traced_on(device, fn):
  """`fn(*args)` traced, forward and backward, with `device` as JAX's default device (None:
  `fn` itself)."""
  if device is None:
    return fn
  where = lambda: jax.default_device(device)

  @jax.custom_vjp
  def call(*args):
    with where():
      return fn(*args)

  def fwd(*args):
    with where():
      return jax.vjp(fn, *args)

  def bwd(vjp, g):
    with where():
      return vjp(g)

  call.defvjp(fwd, bwd)
  return call

