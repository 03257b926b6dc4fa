"""One chip: the Llama 3.2 1B train and KD steps, fused vs reference attention, remat x batch.

  python benchmarks/accelerator.py [--expect-gpu | --expect-tpu] [--quick] [--json PATH]
      [--budget-s 400] [--row-limit-s 150] [--only SUBSTRING] [--model KEY=VALUE ...]

Sized for one short lent call on an H200 or a TPU (scripts/accelerator_run.sh wraps it).

1. The probe: Python, JAX, jaxlib, plugin and library versions, the devices, and a bf16 matmul
   rate next to the datasheet peak that MFU is quoted against.
2. The rows, most informative first (ACCELERATOR_ROWS): the train step with the reference
   attention and with the platform's fused kernel (cuDNN on GPU, splash on TPU) at today's
   8 x 2048 with full remat; then `attention_impl=auto` under each remat policy (none,
   save_dots_no_batch, save_dots, full) at batches up to 32 x 2048 and 4 x 8192; the KD step
   (LogitKD, a frozen teacher of twice the student's parameters).
   Each row reports the step time, tokens/s, MFU in the causal and in the PaLM convention, the
   compiled step's bytes and the runtime peak (`memory_stats()['peak_bytes_in_use']`).

Every row runs in its own process (benchmarks/lib/accelerator_row.py) under a time limit, the
smaller of --row-limit-s and what is left of --budget-s, with XLA_PYTHON_CLIENT_MEM_FRACTION
raised (--mem-fraction); a row whose compiled step exceeds the chip is reported, not run. The
JSON is rewritten after every row, so a run cut short still returns the rows it finished.

--expect-gpu / --expect-tpu: if JAX runs on anything else (a CPU fallback), print one line and
exit 3 before any row. Without them a CPU runs the demo pair (--quick: the tiny pair), the
reference attention against the blockwise one and the KD step, as a check of the bookkeeping
rather than a figure.

Writes benchmarks/results/accelerator.json (--json PATH, or --out DIR).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)
# No JAX in this process: it would take the chip (and its memory) from the rows, each of which
# runs in its own process (lib/accelerator_row.py) so that its peak memory is its own.

from benchmarks.lib import accelerator_table, subproc  # noqa: E402

ROW_SCRIPT = Path(__file__).resolve().parent / "lib" / "accelerator_row.py"
REFUSED_EXIT = 3  # accelerator_row.REFUSED_EXIT (not imported: that module is the JAX side)
STOPPED_EXIT = 124  # stopped by SIGTERM/SIGINT (what `timeout` itself returns)
MIN_ROW_S = 30.0  # a row is not started with less of the budget left than this
FUSED = {"gpu": "cudnn", "tpu": "splash"}  # the platform's fused attention kernel

# (kind, attention_impl, remat, batch, seq_len); "fused" = FUSED[platform]. Ordered by what a
# short call must not miss: fused vs reference first, then remat x batch, then the KD step.
ACCELERATOR_ROWS = (
    ("train", "reference", "full", 8, 2048),
    ("train", "fused", "full", 8, 2048),
    ("train", "auto", "save_dots_no_batch", 16, 2048),
    ("train", "auto", "none", 8, 2048),
    ("distill", "auto", "full", 8, 2048),
    ("train", "auto", "full", 32, 2048),
    ("train", "auto", "save_dots", 16, 2048),
    ("train", "auto", "none", 16, 2048),
    ("train", "auto", "save_dots_no_batch", 32, 2048),
    ("train", "auto", "full", 4, 8192),
    ("distill", "reference", "full", 8, 2048),
    ("train", "blockwise", "full", 8, 2048),
)
# On CPU: reference against blockwise (the same losses, from the same weights and data), and KD.
CPU_ROWS = (("train", "reference", "none", 8, 256), ("train", "blockwise", "none", 8, 256),
            ("distill", "auto", "none", 8, 256))
QUICK_ROWS = (("train", "reference", "none", 4, 32), ("train", "blockwise", "none", 4, 32),
              ("distill", "auto", "none", 4, 32))


def row_specs(backend: str, args) -> list[dict]:
  """The rows to run on `backend`, as the specs accelerator_row.py takes."""
  accelerated = backend in FUSED and not args.quick
  table = ACCELERATOR_ROWS if accelerated else QUICK_ROWS if args.quick else CPU_ROWS
  preset = "llama3.2-1b" if accelerated else "tiny" if args.quick else "demo_student"
  steps, reps = (2, 3) if accelerated else (1, 2) if args.quick else (2, 3)
  specs = []
  for kind, impl, remat, batch, seq_len in table:
    impl = FUSED.get(backend, "reference") if impl == "fused" else impl
    name = f"{kind}/{impl}/{remat}/{batch}x{seq_len}"
    if args.only and not any(s in name for s in args.only):
      continue
    specs.append({"name": name, "kind": kind, "preset": preset, "attention_impl": impl,
                  "remat": remat, "batch": batch, "seq_len": seq_len, "steps": steps,
                  "reps": reps, "overrides": dict(args.model)})
  return specs


class Stopped(Exception):
  """SIGTERM or SIGINT reached this process (an outer `timeout`, Ctrl-C)."""


def _stop(signum, frame):
  raise Stopped(signal.Signals(signum).name)


def run_row(argv: list[str], out_file: Path, limit_s: float, env: dict) -> dict:
  """Runs one row's process for at most `limit_s`; returns what it wrote to `out_file` with its
  exit status, or {"status": "timeout" | "crashed"} over what it had written so far.

  The row runs in its own process group, so that killing it kills its children too; when this
  process is stopped (`Stopped`), the row is killed first and the result says so
  ("stopped": the signal's name).
  """
  start = time.perf_counter()
  proc = subprocess.Popen(argv, env=env, process_group=0)
  stopped = None
  try:
    code = proc.wait(timeout=max(limit_s, 1.0))
  except subprocess.TimeoutExpired:
    code = None
  except Stopped as e:
    code, stopped = None, str(e)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  result = json.loads(out_file.read_text()) if out_file.exists() else {}
  result.update(exit_code=code, wall_s=time.perf_counter() - start)
  if stopped:
    result.update(status="stopped", stopped=stopped,
                  error=f"the run got {stopped} while {_phase(result)}; the row was killed")
  elif code is None:
    result.update(status="timeout",
                  error=f"killed at its {limit_s:.0f}s limit while {_phase(result)}")
  elif result.get("status") in (None, "started", "compiled", "probing"):
    result.update(status="crashed",
                  error=f"the row's process exited {code} while {_phase(result)}")
  return result


def _phase(result: dict) -> str:
  return {"compiled": "running the compiled step", "probing": "probing"}.get(
      result.get("status"), "starting or compiling")


class Results:
  """The JSON file: rewritten whole (atomically) after the probe and after every row."""

  def __init__(self, path: Path, payload: dict):
    self.path, self.payload = path, payload
    self.write()

  def write(self) -> None:
    self.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = self.path.with_suffix(".tmp")
    tmp.write_text(json.dumps(self.payload, indent=1) + "\n")
    os.replace(tmp, self.path)

  def add_row(self, row: dict) -> None:
    self.payload["rows"].append(row)
    self.write()


def row_env(mem_fraction: float) -> dict:
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(mem_fraction))
  env["PYTHONUNBUFFERED"] = "1"
  return env


def run_all(specs, results: Results, launch, budget_s: float, row_limit_s: float,
            start: float) -> None:
  """Runs the rows in order, each under min(row limit, budget left), recording each at once;
  rows the budget no longer covers are recorded as skipped."""
  for spec in specs:
    left = budget_s - (time.perf_counter() - start)
    if left < MIN_ROW_S:
      results.add_row({"name": spec["name"], "spec": spec, "status": "skipped",
                       "error": f"{left:.0f}s of the {budget_s:.0f}s budget left"})
      continue
    print(f"== {spec['name']} (limit {min(row_limit_s, left):.0f}s)", flush=True)
    row = launch(spec, min(row_limit_s, left))
    results.add_row(row)
    if row.get("stopped"):
      return


def parse_args(argv=None):
  parser = subproc.base_parser(__doc__.splitlines()[0])
  expect = parser.add_mutually_exclusive_group()
  expect.add_argument("--expect-gpu", dest="expect", action="store_const", const="gpu",
                      help="fail (exit 3, one line) unless JAX runs on a GPU")
  expect.add_argument("--expect-tpu", dest="expect", action="store_const", const="tpu",
                      help="fail (exit 3, one line) unless JAX runs on a TPU")
  parser.add_argument("--json", default=None, help="result file (default: OUT/accelerator.json)")
  parser.add_argument("--budget-s", type=float, default=400.0,
                      help="seconds for the probe and every row together")
  parser.add_argument("--row-limit-s", type=float, default=150.0, help="seconds per row at most")
  parser.add_argument("--mem-fraction", type=float, default=0.95,
                      help="XLA_PYTHON_CLIENT_MEM_FRACTION of the rows (unless already set)")
  parser.add_argument("--only", action="append", default=[],
                      help="run only rows whose name holds this (repeatable)")
  parser.add_argument("--model", action="append", default=[], type=_key_value,
                      help="model config field for every row, e.g. --model scan_layers=true")
  return subproc.parse_args(parser, argv)


def _key_value(text: str) -> tuple[str, object]:
  key, sep, value = text.partition("=")
  if not sep or not key:
    raise argparse.ArgumentTypeError(f"--model {text!r}: expected FIELD=VALUE")
  try:
    return key, json.loads(value)
  except json.JSONDecodeError:
    return key, value  # a bare string, e.g. --model attention_impl=blockwise


def main(argv=None) -> int:
  args = parse_args(argv)
  start = time.perf_counter()
  signal.signal(signal.SIGTERM, _stop)
  signal.signal(signal.SIGINT, _stop)
  path = Path(args.json or Path(args.out) / "accelerator.json")
  env = row_env(args.mem_fraction)
  expect = ["--expect", args.expect] if args.expect else []
  results = Results(path, {"benchmark": "accelerator", "argv": sys.argv[1:], "quick": args.quick,
                           "expect": args.expect, "budget_s": args.budget_s,
                           "row_limit_s": args.row_limit_s, "status": "probing", "probe": None,
                           "rows": []})
  numbers = itertools.count()
  with tempfile.TemporaryDirectory(prefix="accelerator-rows-") as tmp:
    def launch(spec: dict, limit_s: float) -> dict:
      out = Path(tmp) / f"row{next(numbers)}.json"
      argv = [sys.executable, str(ROW_SCRIPT), "--spec", json.dumps(spec), "--out", str(out)]
      return run_row(argv + expect, out, limit_s, env)

    probe = launch({"name": "probe", "kind": "probe"}, min(args.row_limit_s, args.budget_s))
    results.payload["probe"] = probe
    if probe.get("status") == "refused" or probe.get("exit_code") == REFUSED_EXIT:
      results.payload["status"] = "refused"
      results.write()
      print(f"accelerator.py: FAIL: {probe.get('refused', probe.get('error'))}", file=sys.stderr)
      return REFUSED_EXIT
    if probe.get("status") != "ok" and not probe.get("stopped"):
      results.payload["status"] = "probe failed"
      results.write()
      print(f"accelerator.py: FAIL: the probe did not run ({probe.get('status')}): "
            f"{probe.get('error')}", file=sys.stderr)
      return 1
    results.payload["status"] = "running"
    if not probe.get("stopped"):
      run_all(row_specs(probe.get("backend") or "unknown", args), results, launch,
              args.budget_s, args.row_limit_s, start)
  stopped = [r["stopped"] for r in [probe] + results.payload["rows"] if r.get("stopped")]
  results.payload.update(status=f"stopped by {stopped[0]}" if stopped else "done",
                         wall_s=time.perf_counter() - start)
  results.write()
  print(accelerator_table.report(results.payload))
  print(f"wrote {path} ({time.perf_counter() - start:.0f}s)")
  return STOPPED_EXIT if stopped else 0 if accelerator_table.all_ran(results.payload) else 1


if __name__ == "__main__":
  sys.exit(main())
