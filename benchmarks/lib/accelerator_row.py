"""One row of benchmarks/accelerator.py, in its own process: the probe, or one train/KD step.

  python benchmarks/lib/accelerator_row.py --spec '{"kind": "train", ...}' --out ROW.json

accelerator.py starts one of these per row, under a time limit, so that a row that compiles for
too long, runs out of memory or crashes costs that row alone, and every row starts on an empty
chip: its `peak_bytes_in_use` is its own. The row's result is written to --out after each phase
(compiled, then timed), so a row killed at its limit still leaves what it had measured.

Kinds (the spec's "kind"; what they measure is lib/accelerator_measure.py, this file is the
process around it):
- probe: Python/JAX/plugin versions, the devices, and a bf16 matmul rate (the chip's practical
  peak, next to the datasheet figure MFU is reported against).
- train / distill: the trainer's step (`build_engine`) for one preset, attention
  implementation, remat policy and batch, on a 1x1 mesh (dp). distill adds a frozen teacher of
  about twice the student's parameters and LogitKD on chunked logits (the trainer's objective).

Exit status 3 (and {"status": "refused"}) when --expect names a platform JAX is not running on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)  # one chip; on CPU, one host device

import jax  # noqa: E402

REFUSED_EXIT = 3  # --expect-gpu/--expect-tpu, and JAX runs elsewhere
# Distributions whose versions the probe reports (absent ones are reported as None).
VERSION_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
                    "jax-cuda12-pjrt", "libtpu", "flax", "optax", "orbax-checkpoint", "grain",
                    "qwix", "ml-collections", "clu", "numpy")
EXPECT_PLATFORMS = {"gpu": "gpu", "tpu": "tpu"}  # --expect value -> jax.default_backend()


class RowFile:
  """The row's result, rewritten whole after every phase (atomic: write then rename)."""

  def __init__(self, path: str, spec: dict):
    self.path = Path(path)
    self.data = {"name": spec.get("name", spec["kind"]), "spec": spec, "status": "started"}

  def update(self, **fields) -> None:
    self.data.update(fields)
    tmp = self.path.with_suffix(".tmp")
    tmp.write_text(json.dumps(self.data, default=_json_default) + "\n")
    os.replace(tmp, self.path)


def _json_default(x):
  if hasattr(x, "item"):
    return x.item()
  if isinstance(x, tuple):
    return list(x)
  return str(x)


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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--spec", required=True, help="the row, as JSON")
  parser.add_argument("--out", required=True, help="where the row's JSON goes")
  parser.add_argument("--expect", choices=sorted(EXPECT_PLATFORMS), default=None)
  args = parser.parse_args(argv)
  spec = json.loads(args.spec)
  row = RowFile(args.out, spec)
  platform_info = check_platform(args.expect)
  if "refused" in platform_info:
    row.update(status="refused", **platform_info)
    return REFUSED_EXIT
  start = time.perf_counter()
  try:
    # Imported here: on a bare accelerator image a carried library may be missing, and that
    # must come back as this row's error in the JSON, not as a crash that says nothing.
    from benchmarks.lib import accelerator_measure as measure
    if spec["kind"] == "probe":
      measure.probe(row, platform_info, package_versions())
    else:
      measure.step_row(row, spec)
  except Exception as e:  # noqa: BLE001 - one row's failure is that row's result
    row.update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
    print(f"row {row.data['name']} failed: {type(e).__name__}: {e}"[:2000], flush=True)
  row.update(row_s=time.perf_counter() - start)
  return 0


if __name__ == "__main__":
  sys.exit(main())
