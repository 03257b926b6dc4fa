"""The same train step under every backend: step time, compile time and memory, vs jit+dp.

  python benchmarks/backends.py [--quick] [--model demo_teacher] [--batch 16] [--seq-len 128]

On 8 simulated CPU devices, one model and one batch: `jit` under each partitioning preset,
`shard_map`, `pmap` and `vmap` (8 workers emulated on one device), timed round-robin so machine
noise hits all alike; ratios are medians of per-round ratios to jit+dp. Memory is per device from
the compiled executable (pmap compiles lazily inside jax.pmap and exposes none: n/a). Every
variant starts from the same weights and takes the same steps, so their final losses must agree.

Writes benchmarks/results/backends.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=8)

from benchmarks.lib import backend_suite, common, subproc  # noqa: E402
from distillax.models import get_preset  # noqa: E402

QUICK_ONLY = ("jit/dp", "shard_map", "vmap")


def main() -> int:
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--model", default="demo_teacher", help="model preset name")
  parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--reps", type=int, default=5, help="interleaved timing rounds")
  args = subproc.parse_args(parser)
  if args.quick:
    args.model, args.batch, args.seq_len, args.reps = "tiny", 8, 32, 2

  print(f"{args.model}: global batch {args.batch} x {args.seq_len} on {args.devices} devices",
        flush=True)
  res = backend_suite.run(get_preset(args.model), batch=args.batch, seq_len=args.seq_len,
                          reps=args.reps, steps_per_rep=1 if args.quick else 2,
                          only=QUICK_ONLY if args.quick else None)
  res["preset"] = args.model
  key = backend_suite.ratio_key(res)
  print(f"\n{args.model}: median of {res['reps']} interleaved rounds; memory per device")
  print(common.format_table(res["rows"], [
      ("variant", lambda r: r["variant"]), ("mesh", lambda r: r["mesh"]),
      ("step ms", lambda r: common.fmt_ms(r["step_s"])),
      ("vs jit/dp", lambda r: common.fmt_ratio(r[key])),
      ("compile s", lambda r: f"{r['compile_s']:.1f}" + ("*" if r.get("compile_s_estimated")
                                                         else "")),
      ("args", lambda r: common.fmt_bytes(r["argument_bytes"])),
      ("temp", lambda r: common.fmt_bytes(r["temp_bytes"])),
      ("out", lambda r: common.fmt_bytes(r["output_bytes"])),
      ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}")]))
  if any(r.get("compile_s_estimated") for r in res["rows"]):
    print("* pmap compiles lazily at its first calls: warm-up time minus two steady steps")
  c = res["loss_check"]
  print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['check']} (max rel diff {c['max_rel_diff']:.2e})")
  payload = {"benchmark": "backends", "quick": args.quick, "machine": common.machine_info(),
             **res}
  path = common.write_json(args.out, "backends", payload)
  print(f"wrote {path}")
  return 0 if c["pass"] else 1


if __name__ == "__main__":
  sys.exit(main())
