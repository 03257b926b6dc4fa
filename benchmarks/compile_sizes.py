"""Accelerator-benchmark candidates compiled for a TPU from this CPU host (libtpu's deviceless
compile, no chip): each one's compiled peak against the chip's memory, before a chip call.

  python benchmarks/compile_sizes.py 'train:full:1:seq_len=16384:loss_impl=sliced:pair=real' ...
      [--target tpu:v5e-1] [--json PATH (default benchmarks/results/compile_sizes.json)]

A candidate is a lever-grid variant (benchmarks/lib/lever_grid.py, as benchmarks/accelerator.py
names them, the pair option included). The step is the one the chip would run: lever_grid.lower
over the target's device (attention resolves to splash for a TPU target, models/attention/impl).
Chip time is scarce: a candidate whose compiled peak is past the chip's memory is not worth a
call. Needs the aot extra (libtpu); on 2 cores the real pair compiles in about a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

from benchmarks.lib import common, lever_grid  # noqa: E402
from distillax.framework import backends, targets  # noqa: E402

GIB = 2 ** 30
RESULTS = Path(__file__).resolve().parent / "results"
# The lent v5e's bytes_limit (jax.devices()[0].memory_stats(), benchmarks/results/tpu/): what
# benchmarks/accelerator.py holds a candidate's compiled peak against (at most 0.97 of it).
V5E_BYTES_LIMIT = 16_909_336_064


def compile_for(variant_text: str, devices: list, seq_len: int = 2048) -> dict:
  """The variant's step compiled for `devices[0]`: its compiled memory, in bytes."""
  variant = lever_grid.Variant.parse(variant_text, seq_len)
  pair = lever_grid.pair_configs(variant.option("pair", "real"))
  t0 = time.perf_counter()
  exe = lever_grid.lower(variant, pair, device=devices[0]).lowered.compile()
  seconds = time.perf_counter() - t0
  stats = backends.compiled_stats(exe)
  return {"variant": variant.name, "compiled_peak": common.peak_bytes(stats),
          "compile_s": seconds, **{k: stats[k] for k in sorted(stats)}}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("variants", nargs="+")
  parser.add_argument("--target", default="tpu:v5e-1")
  parser.add_argument("--json", default=str(RESULTS / "compile_sizes.json"),
                      help="result file (default: benchmarks/results/compile_sizes.json)")
  parser.add_argument("--limit-bytes", type=int, default=V5E_BYTES_LIMIT,
                      help="the chip's memory (default: the lent v5e's)")
  parser.add_argument("--devices", default=None, help=argparse.SUPPRESS)  # the prologue's
  args = parser.parse_args(argv)
  target = targets.parse_target(args.target)
  devices = targets.target_devices(target)
  limit = args.limit_bytes
  rows = []
  for text in args.variants:
    try:
      row = compile_for(text, devices)
    except Exception as e:  # noqa: BLE001 - the compiler's own out-of-memory refusal
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      rows.append({"variant": text, "does_not_fit": str(e).splitlines()[0]})
      print(f"{text}: DOES NOT FIT ({str(e).splitlines()[0]})", flush=True)
      continue
    rows.append(row)
    fits = " fits" if row["compiled_peak"] <= 0.97 * limit else " DOES NOT FIT"
    print(f"{row['variant']}: compiled peak {row['compiled_peak'] / GIB:.2f} GiB"
          f"{fits} ({row['compile_s']:.0f} s)", flush=True)
  Path(args.json).write_text(json.dumps({"target": args.target, "rows": rows}, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
