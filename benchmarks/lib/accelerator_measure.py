"""What the one-chip benchmarks (accelerator.py, tpu_levers.py) measure of the chip itself: the
platform check (--expect-tpu / --expect-gpu), the package versions, a bf16 matmul rate, and
the teacher shape of the continuity pair."""

from __future__ import annotations

import time
from importlib import metadata

import jax
import jax.numpy as jnp

from distillax.models import param_count

EXPECT_PLATFORMS = {"gpu": "gpu", "tpu": "tpu"}  # --expect value -> jax.default_backend()
# Distributions whose versions the probe reports (absent ones are reported as None).
VERSION_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
                    "jax-cuda12-pjrt", "libtpu", "flax", "optax", "orbax-checkpoint", "grain",
                    "qwix", "ml-collections", "clu", "numpy")


def package_versions() -> dict[str, str | None]:
  out = {}
  for name in VERSION_PACKAGES:
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  return out


def check_platform(expect: str | None) -> dict:
  """The backend JAX runs on; with `expect`, a one-line refusal if it is not that platform."""
  try:
    devices = jax.devices()
    backend = jax.default_backend()
  except Exception as e:  # noqa: BLE001 - a plugin that fails to start: report it in one line
    return {"backend": None, "refused": f"JAX could not start a backend: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")}
  out = {"backend": backend, "devices": [str(d) for d in devices],
         "device_kind": devices[0].device_kind}
  if expect and backend != EXPECT_PLATFORMS[expect]:
    plugins = {k: v for k, v in package_versions().items()
               if v and ("cuda" in k or k == "libtpu")}
    out["refused"] = (f"--expect-{expect}, but JAX {jax.__version__} runs on {backend!r} "
                      f"(devices {out['devices']}; accelerator plugins installed: "
                      f"{plugins or 'none'}): it fell back to CPU, so no figure would be "
                      f"an accelerator's")
  return out


def matmul_probe(backend: str) -> dict:
  """Best and median bf16 n x n x n matmul rate (2 n^3 FLOPs each), the first call untimed."""
  n, reps = (8192, 10) if backend in ("gpu", "tpu") else (256, 5)
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()
  rates = []
  for _ in range(reps):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    rates.append(2.0 * n ** 3 / max(time.perf_counter() - start, 1e-9))
  rates.sort()
  return {"n": n, "reps": reps, "dtype": "bfloat16", "best_flops_per_s": rates[-1],
          "median_flops_per_s": rates[len(rates) // 2]}


def teacher_twice(student_cfg):
  """The student's shapes with as many layers as make about twice its parameters."""
  total = param_count(student_cfg)
  per_layer = (param_count(student_cfg.replace(num_layers=2)) -
               param_count(student_cfg.replace(num_layers=1)))
  rest = total - per_layer * student_cfg.num_layers
  layers = max(student_cfg.num_layers + 1, round((2 * total - rest) / per_layer))
  return student_cfg.replace(num_layers=layers)


