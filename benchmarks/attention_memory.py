"""Compiled memory of a Llama-3.2-1B-shape train step: reference attention against blockwise.

  python benchmarks/attention_memory.py [--quick] [--lengths 2048,8192,32768]

The step is the one `distillax train` compiles (`build_engine` with the lm objective and the
default AdamW), compiled only (abstract parameters: nothing is allocated), on one device, batch 1,
with `remat='full'` and scanned layers, fp32 master weights and bf16 compute (as
configs/llama3_8b.py trains). Only `model.attention_impl` differs between the two rows of a
length: `reference` materialises the fp32 (B, K, G, L, S) scores and probabilities of a layer,
`blockwise` holds one (512, 512) block pair at a time. Figures are XLA's own
(`compiled.memory_analysis()`): temporaries (activations and workspace) and arguments (the
parameters, optimizer state and batch). The loss is the chunked next-token loss in both.
Target: blockwise temporaries at most 1/4 of reference at 1 x 8192 (PASS/FAIL).

--quick: a two-layer test-size model at 512 and 2048 tokens, checked at 2048 (the smoke test).
Writes benchmarks/results/attention_memory[_quick].json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

from benchmarks.lib import common, subproc  # noqa: E402
from distillax.models import get_preset  # noqa: E402

IMPLS = ("reference", "blockwise")
TARGET = 0.25  # blockwise temporaries / reference temporaries at the checked length
FULL = {"preset": "llama3.2-1b", "lengths": (2048, 8192, 32768), "checked": 8192}
QUICK = {"preset": "tiny", "lengths": (512, 2048), "checked": 2048}


def model_config(preset: str, impl: str, length: int):
  changes = dict(scan_layers=True, remat="full", param_dtype="float32", dtype="bfloat16",
                 attention_impl=impl, max_seq_len=max(length, 128))
  if preset == "tiny":
    changes["num_layers"] = 2
  return get_preset(preset, **changes)


def measure(preset: str, impl: str, length: int) -> dict:
  """One compile: the step's memory figures, or the error if it cannot compile here."""
  cfg = model_config(preset, impl, length)
  start = time.perf_counter()
  try:
    built = common.build(cfg, "dp", (1, 1), "jit", 1, length, abstract=True)
  except Exception as e:  # an XLA allocation/compile failure is a result to report
    return {"impl": impl, "seq_len": length, "error": f"{type(e).__name__}: {e}"[:500]}
  stats = built.engine.runner.stats
  return {"impl": impl, "seq_len": length, "batch": 1,
          "temp_bytes": stats.get("temp_size_in_bytes"),
          "argument_bytes": stats.get("argument_size_in_bytes"),
          "output_bytes": stats.get("output_size_in_bytes"),
          "alias_bytes": stats.get("alias_size_in_bytes"),
          "compile_seconds": time.perf_counter() - start}


def add_ratios(rows: list[dict]) -> None:
  ref = {r["seq_len"]: r for r in rows if r["impl"] == "reference"}
  for r in rows:
    base = ref.get(r["seq_len"], {})
    if r.get("temp_bytes") is not None and base.get("temp_bytes"):
      r["temp_ratio_to_reference"] = r["temp_bytes"] / base["temp_bytes"]


def main() -> int:
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--lengths", default=None, help="comma-separated sequence lengths")
  args = subproc.parse_args(parser)

  s = dict(QUICK if args.quick else FULL)
  if args.lengths:
    s["lengths"] = tuple(int(x) for x in args.lengths.split(","))
  rows = []
  for length in s["lengths"]:
    for impl in IMPLS:
      print(f"compiling {s['preset']} {impl} at 1 x {length} ...", flush=True)
      rows.append(measure(s["preset"], impl, length))
      print(f"  {rows[-1].get('error') or common.fmt_bytes(rows[-1]['temp_bytes'])}", flush=True)
  add_ratios(rows)
  print(f"\n{s['preset']} train step, batch 1, remat=full, scanned layers, one "
        f"{common.machine_info()['platform']} device (compiled, nothing allocated)")
  print(common.format_table(rows, [
      ("tokens", lambda r: f"1 x {r['seq_len']}"), ("attention", lambda r: r["impl"]),
      ("temporaries", lambda r: common.fmt_bytes(r.get("temp_bytes"))),
      ("vs reference", lambda r: common.fmt_ratio(r.get("temp_ratio_to_reference"))),
      ("arguments", lambda r: common.fmt_bytes(r.get("argument_bytes"))),
      ("compile s", lambda r: f"{r['compile_seconds']:.0f}" if "compile_seconds" in r
       else r.get("error", "")[:60]),
  ]))
  checked = next((r for r in rows if r["impl"] == "blockwise" and r["seq_len"] == s["checked"]),
                 {})
  ratio = checked.get("temp_ratio_to_reference")
  ok = ratio is not None and ratio <= TARGET
  print(f"{'PASS' if ok else 'FAIL'}  1 x {s['checked']}: blockwise temporaries "
        f"{common.fmt_ratio(ratio)} of reference (target <= {TARGET})")
  payload = {"machine": common.machine_info(), "quick": args.quick, "settings": s,
             "config": common.config_summary(model_config(s["preset"], "blockwise", 1)),
             "rows": rows, "check": {"seq_len": s["checked"], "ratio": ratio, "target": TARGET,
                                     "pass": ok}}
  path = common.write_json(args.out, "attention_memory_quick" if args.quick
                           else "attention_memory", payload)
  print(f"\nwrote {path}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
