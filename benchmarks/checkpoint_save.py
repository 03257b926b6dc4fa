"""How long does orbax take to write a training state, by its storage options? The end of a run
waits for its last save.

  python benchmarks/checkpoint_save.py [--gib 3.5] [--arrays 28] [--dir /tmp/ckpt_bench]
      [--json PATH (default benchmarks/results/checkpoint_save.json)]

On the lent v5e the final save of distill_qwen3.py's ~7 GB state committed 10.5 s after it
started (chip call 34), while the copies off the chip run at ~3 GB/s there
(benchmarks/host_copy.py): most of the save is orbax and tensorstore writing on the host. Each
variant saves the same fresh device arrays (fp32, random normal: weights compress little) with
orbax's PyTree handler, as the trainer's checkpoints are written (OCDBT, zarr2, zstd level 1
compression), or without compression, or without OCDBT. Rows: seconds, GB/s of the arrays,
bytes on disk. On a CPU: a check of the bookkeeping.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from benchmarks.lib import common  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {"ocdbt+zstd (the trainer's)": dict(use_ocdbt=True, use_compression=True),
            "ocdbt, no compression": dict(use_ocdbt=True, use_compression=False),
            "zarr files, zstd": dict(use_ocdbt=False, use_compression=True),
            "zarr files, no compression": dict(use_ocdbt=False, use_compression=False)}


def _state(n: int, elems: int, seed: int) -> dict:
  make = jax.jit(lambda k: jax.random.normal(k, (elems,), jnp.float32) * 0.02)
  state = {f"w{i:02d}": make(jax.random.key(seed * 1000 + i)) for i in range(n)}
  return jax.block_until_ready(state)


def _disk_bytes(path: Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(gib: float, n: int, root: Path, jsonl: Path | None) -> list[dict]:
  elems = int(gib * 2**30 / 4 / n)
  rows = []
  for i, (name, options) in enumerate(VARIANTS.items()):
    state = _state(n, elems, seed=i)
    path = root / f"v{i}"
    shutil.rmtree(path, ignore_errors=True)
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options))
    start = time.perf_counter()
    checkpointer.save(path, args=ocp.args.PyTreeSave(state))
    seconds = time.perf_counter() - start
    row = {"variant": name, **options, "arrays": n, "bytes": 4 * elems * n, "seconds": seconds,
           "gb_per_s": 4 * elems * n / seconds / 1e9, "disk_bytes": _disk_bytes(path),
           "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind}
    shutil.rmtree(path, ignore_errors=True)
    rows.append(row)
    common.emit_row(row, jsonl)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--gib", type=float, default=None)
  p.add_argument("--arrays", type=int, default=28)
  p.add_argument("--dir", type=Path, default=Path("/tmp/ckpt_bench"))
  p.add_argument("--jsonl", type=Path, default=None, help="append each row as it finishes")
  p.add_argument("--json", type=Path, default=None)
  p.add_argument("--devices", type=int, default=None)
  a = p.parse_args(argv)
  on_chip = jax.default_backend() != "cpu"
  gib = a.gib if a.gib is not None else (3.5 if on_chip else 0.25)
  rows = run(gib, a.arrays, a.dir, a.jsonl)
  out = a.json or RESULTS / ("checkpoint_save.json" if on_chip else "checkpoint_save_quick.json")
  common.write_json(out.parent, out.stem, {"machine": common.machine_info(), "rows": rows})


if __name__ == "__main__":
  main()
