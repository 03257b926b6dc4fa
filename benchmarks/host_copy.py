"""How fast does a training state leave the chip? Device-to-host copy bandwidth, by how the
copies are issued, for a state shaped like distill_qwen3.py's checkpoint.

  python benchmarks/host_copy.py [--gib 7] [--arrays 28] [--json PATH
      (default benchmarks/results/host_copy.json)]

Why: the end of a run saves its state (configs/distill_qwen3.py: ~7 GB of fp32 weights and
Adam moments), and on the lent v5e copies to the host ran at 0.5-0.8 GB/s, most of the 13 s
between its last eval and the process's exit. Each way is timed on fresh arrays of the same
total (`--arrays` fp32 arrays of `--gib` GiB in all):
- `serial`: np.asarray of each array in turn (one copy in flight);
- `async`: copy_to_host_async on every array first, then np.asarray of each (every copy in
  flight: what framework/run/checkpoint.copy_to_host_early does before a save);
- `pinned_host`: jax.device_put of each array to the device's pinned host memory (a DMA the
  runtime schedules), then np.asarray of the host arrays;
- `bf16_pairs`: as `async` for two bf16 halves of each word (hi, lo; the same bytes), a check
  that the bandwidth does not depend on the dtype.
Rows: seconds and GB/s. On a CPU the copies are memcpys: a check of the bookkeeping only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.lib import common  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _fresh(n: int, elems: int, salt: int):
  """n fp32 arrays on the device, computed there (nothing of them on the host yet)."""
  make = jax.jit(lambda i: jnp.arange(elems, dtype=jnp.float32) * (i + salt))
  arrays = [make(i) for i in range(n)]
  jax.block_until_ready(arrays)
  return arrays


def _serial(arrays):
  return [np.asarray(x) for x in arrays]


def _async(arrays):
  for x in arrays:
    x.copy_to_host_async()
  return [np.asarray(x) for x in arrays]


def _pinned(arrays):
  dev = arrays[0].sharding
  host = dev.with_memory_kind("pinned_host")
  moved = [jax.device_put(x, host) for x in arrays]
  jax.block_until_ready(moved)
  return [np.asarray(x) for x in moved]


def _bf16_halves(arrays):
  """Each fp32 array as its two bf16 halves (hi, lo): the same bytes in twice the arrays."""
  split = jax.jit(lambda x: tuple(jax.lax.bitcast_convert_type(x, jnp.bfloat16)[..., j]
                                  for j in (0, 1)))
  return [h for x in arrays for h in split(x)]


# way -> (what is done untimed to the fresh arrays first, the timed copy)
WAYS = {"serial": (list, _serial), "async": (list, _async), "pinned_host": (list, _pinned),
        "bf16_pairs": (_bf16_halves, _async)}


def run(gib: float, n: int, jsonl: Path | None):
  elems = int(gib * 2**30 / 4 / n)
  total = 4 * elems * n
  rows = []
  for i, (name, (prepare, copy)) in enumerate(WAYS.items()):
    arrays = jax.block_until_ready(prepare(_fresh(n, elems, salt=i)))
    row = {"way": name, "arrays": n, "bytes": total, "backend": jax.default_backend(),
           "device_kind": jax.devices()[0].device_kind}
    try:
      start = time.perf_counter()
      got = copy(arrays)
      seconds = time.perf_counter() - start
      row.update(seconds=seconds, gb_per_s=total / seconds / 1e9,
                 host_bytes=int(sum(g.nbytes for g in got)))
      del got
    except Exception as e:  # a way this runtime refuses: its row says why
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    del arrays
    rows.append(row)
    common.emit_row(row, jsonl)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--gib", type=float, default=None)
  p.add_argument("--arrays", type=int, default=28)
  p.add_argument("--jsonl", type=Path, default=None, help="append each row as it finishes")
  p.add_argument("--json", type=Path, default=None)
  p.add_argument("--devices", type=int, default=None)
  a = p.parse_args(argv)
  on_chip = jax.default_backend() != "cpu"
  gib = a.gib if a.gib is not None else (7.0 if on_chip else 0.25)
  rows = run(gib, a.arrays, a.jsonl)
  out = a.json or RESULTS / ("host_copy.json" if on_chip else "host_copy_quick.json")
  common.write_json(out.parent, out.stem, {"machine": common.machine_info(), "rows": rows})


if __name__ == "__main__":
  main()
