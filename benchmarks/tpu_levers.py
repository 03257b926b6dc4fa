"""One chip, one process: each performance lever of the train, KD and on-policy steps, measured
side by side.

  python benchmarks/tpu_levers.py --pair real --grid 'train:full:8,train:none:2,kd:full:8' \
      [--profile train:full:8] [--out DIR] [--tiny]

What a lever costs or buys is only known on the chip, and a lent chip's time is scarce, so this
script does everything in one process:

1. The probe: a bf16 8192^3 matmul rate next to the datasheet peak MFU is quoted against.
2. Model creation timed apart (trace + lower, compile, run), student and teacher.
3. Every variant of the grid (`kind:remat:batch[:key=value...]`) traced in turn, then compiled
   in parallel threads (XLA's compile releases the GIL: N variants cost about one compile of
   wall time on a many-core host); each one's compiled memory is read before anything runs.
4. The variants that fit run one after another on one train state (same shapes, so the state a
   step donates feeds the next variant), each timed over a few steps after a warm-up.
5. `--profile VARIANT...`: a jax.profiler trace of two steps of each, tarred into the output
   folder (read it with xprof: benchmarks/lib/profile_ops.py).

Every row is appended to OUT/levers.jsonl as it finishes, so a run cut short keeps its rows.
--tiny runs the same code on CPU with the tiny pair, as a check of the script itself.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import json
import os
import sys
import tarfile
import time
from pathlib import Path

START = time.perf_counter()

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402

from benchmarks.lib import common, lever_grid  # noqa: E402
from benchmarks.lib.accelerator_measure import matmul_probe, package_versions  # noqa: E402
from distillax.framework import throughput  # noqa: E402


ROWS_FILE: list[Path] = []  # where rows go (--rows-file), else OUT/levers.jsonl


def write_row(out: Path, row: dict) -> None:
  with open(ROWS_FILE[0] if ROWS_FILE else out / "levers.jsonl", "a") as f:
    f.write(json.dumps(row, default=str) + "\n")
  print(json.dumps({k: v for k, v in row.items() if k not in ("step_s_all",)}, default=str),
        flush=True)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--pair", default="real", choices=sorted(lever_grid.PAIRS))
  p.add_argument("--grid", required=True, help="comma-separated kind:remat:batch[:k=v...]")
  p.add_argument("--profile", default="", help="comma-separated variants to trace")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--steps", type=int, default=4, help="timed steps per variant")
  p.add_argument("--threads", type=int, default=8, help="parallel compiles")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/levers"))
  p.add_argument("--tiny", action="store_true", help="the tiny pair on CPU (a script check)")
  p.add_argument("--rows-file", default="", help="append rows here (default OUT/levers.jsonl)")
  p.add_argument("--kinds", default="train,kd", choices=("train,kd", "kd,train"),
                 help="which kind of step runs first")
  p.add_argument("--splash-from", default="",
                 help="splash_blocks.json: `splash=best` in a variant takes its fastest tiles")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  ROWS_FILE[:] = [Path(args.rows_file)] if args.rows_file else []
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  backend = jax.default_backend()
  peak, source = throughput.peak_flops_per_device()
  bandwidth, bandwidth_source = throughput.hbm_bandwidth_per_device()
  write_row(out, {"row": "probe", "backend": backend, "device_kind": jax.devices()[0].device_kind,
                  "jax": jax.__version__, "versions": package_versions(),
                  "python": sys.version.split()[0], "peak_flops": peak, "peak_source": source,
                  "hbm_bandwidth": bandwidth, "hbm_source": bandwidth_source,
                  "memory_limit": lever_grid.memory_limit(),
                  "since_start_s": time.perf_counter() - START, "matmul": matmul_probe(backend)})
  pair = lever_grid.pair_configs(args.pair, tiny=args.tiny)
  seq_len = 64 if args.tiny else args.seq_len
  made = {}

  def factories(cfg, role):
    """The ModelFactory of a model config (remat and kernels aside), made and timed once."""
    if cfg not in made:
      made[cfg] = lever_grid.ModelFactory(cfg, seed=0 if role == "student" else 1)
      write_row(out, {"row": f"init/{role}", "scan_layers": cfg.scan_layers,
                      **made[cfg].timing})
    return made[cfg]

  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:  # both inits compile at once
    for role, cfg in pair.items():
      cfg = lever_grid.init_config(cfg)
      made[cfg] = pool.submit(lever_grid.ModelFactory, cfg, seed=0 if role == "student" else 1)
    for role, cfg in pair.items():
      cfg = lever_grid.init_config(cfg)
      made[cfg] = made[cfg].result()
      write_row(out, {"row": f"init/{role}", "scan_layers": cfg.scan_layers, "parallel": True,
                      **made[cfg].timing})
  best = ""
  if args.splash_from and os.path.exists(args.splash_from):
    best = lever_grid.best_splash(args.splash_from, pair["student"].head_dim, seq_len)
    write_row(out, {"row": "splash_best", "options": best})
  variants = [lever_grid.Variant.parse(s, seq_len, best) for s in args.grid.split(",") if s]
  # The first kind runs while the others compile; on-policy steps last.
  order = args.kinds.split(",")
  order += [k for k in lever_grid.KINDS if k not in order]
  variants.sort(key=lambda v: order.index(v.kind))
  with concurrent.futures.ThreadPoolExecutor(max_workers=args.threads) as pool:
    pending = {}
    for v in variants:  # tracing holds the GIL; each compile runs in a thread meanwhile
      t0 = time.perf_counter()
      try:
        low = lever_grid.lower(v, lever_grid.pair_configs(v.option("pair", args.pair),
                                                          tiny=args.tiny), tiny=args.tiny)
      except Exception as e:  # noqa: BLE001 - one variant's failure is its row
        write_row(out, {"row": v.name, "status": "error", "phase": "trace",
                        "error": f"{type(e).__name__}: {e}"[:1500]})
        continue
      pending[v.name] = (pool.submit(lever_grid.compile_timed, low), time.perf_counter() - t0)
    for kind in order:
      group = [v for v in variants if v.kind == kind and v.name in pending]
      if group:
        run_group(group, pending, factories, out, args)
  return 0


def run_group(group, pending, factories, out: Path, args) -> None:
  """Waits for the group's compiles, then runs each variant that fits on one shared state."""
  limit = lever_grid.memory_limit()
  runnable = []
  for v in group:
    future, trace_s = pending[v.name]
    try:
      low, exe, compile_s = future.result()
    except Exception as e:  # noqa: BLE001 - compile errors (VMEM, HBM) are rows too
      write_row(out, {"row": v.name, "status": "error", "phase": "compile", "trace_s": trace_s,
                      "error": f"{type(e).__name__}: {e}"[:1500]})
      continue
    need = lever_grid.compiled_peak(exe)
    row = {"row": v.name, "trace_s": trace_s, "compile_s": compile_s, "compiled_peak": need,
           "memory_limit": limit, **v.summary()}
    if limit and need > 0.97 * limit:
      write_row(out, {**row, "status": "does_not_fit"})
    else:
      runnable.append((low, exe, row))
  profiles = set(filter(None, args.profile.split(",")))
  runnable.sort(key=lambda r: lever_grid.state_key(r[0]), reverse=True)  # scanned first
  session, key = None, None
  for low, exe, row in runnable:
    v = low.variant
    if lever_grid.state_key(low) != key:
      session = None  # frees the last layout's state first
      session = lever_grid.Session(factories, low)
      key = lever_grid.state_key(low)
    try:
      timing = session.time(low, exe, steps=2 if args.tiny else args.steps)
      write_row(out, {**row, "status": "ok", **timing})
      if any(fnmatch.fnmatch(v.name, p) for p in profiles):
        trace_dir = Path("/tmp") / f"profile_{v.safe_name}"
        session.profile(low, exe, trace_dir)
        (trace_dir / "step.hlo.txt").write_text(exe.as_text())
        with tarfile.open(out / f"profile_{v.safe_name}.tgz", "w:gz") as tar:
          tar.add(trace_dir, arcname=v.safe_name)
    except Exception as e:  # noqa: BLE001
      write_row(out, {**row, "status": "error", "phase": "run",
                      "error": f"{type(e).__name__}: {e}"[:1500]})
  del session


if __name__ == "__main__":
  sys.exit(main())
